"""Human-facing outputs of a run: PNG curves and a self-contained HTML report.

The report shows the run's provenance (version, source commit, Prefect flow run id, start/end
time, per-stage timings, config digest, key ids), train and validation curves (with a smoothed
training loss rather than the last batch's), the confusion matrix of the best validation, HE
metrics with what AUC and accuracy mean, the verifier's verdict, and the model card facts.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from securetrain.io.atomic import atomic_write_bytes
from securetrain.pipeline.results import PipelineResult, TrainingSummary
from securetrain.training.architecture import describe_fix


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and value == value


def plot_training_curve(training: TrainingSummary, path: Path) -> Path:
    """Loss (train and validation) and validation accuracy/AUC (regression: RMSE/MAE) as one PNG
    (matplotlib Agg: no display)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_val = bool(training.validation)
    fig, axes = plt.subplots(1, 2 if has_val else 1, figsize=(11 if has_val else 7, 4), dpi=110, squeeze=False)
    ax = axes[0][0]
    if training.curve:
        steps, losses = zip(*training.curve)
        ax.plot(steps, losses, color="#1f6feb", linewidth=1.8, label="training loss")
        for ckpt in training.checkpoints:
            ax.axvline(ckpt.step, color="#999999", linewidth=0.8, linestyle=":")
    val = [(v["step"], v["loss"]) for v in training.validation if _finite(v.get("loss"))]
    if val:
        ax.plot(*zip(*val), color="#d1242f", marker="o", linewidth=1.5, label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(f"Loss on {training.device} (dotted: encrypted checkpoints)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    if has_val:
        ax2 = axes[0][1]
        regression = training.task_kind == "regression"
        keys = (("rmse", "#1a7f37"), ("mae", "#8250df")) if regression else (("accuracy", "#1a7f37"), ("auc", "#8250df"))
        for key, colour in keys:
            points = [(v["epoch"], v[key]) for v in training.validation if _finite(v.get(key))]
            if points:
                ax2.plot(*zip(*points), marker="o", color=colour, label=f"validation {key}")
        if training.best and _finite(training.best.get("epoch")):
            ax2.axvline(training.best["epoch"], color="#999999", linestyle="--", linewidth=0.8,
                        label=f"best {training.best['metric']}")
        ax2.set_xlabel("epoch")
        if not regression:  # accuracy and AUC lie in [0, 1]; errors are in the target's units
            ax2.set_ylim(-0.02, 1.02)
        ax2.set_title("Validation on the held-out split")
        ax2.grid(alpha=0.3)
        ax2.legend(loc="lower right")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue(), mode=0o644)
    return path


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.3e}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _table(rows: list[tuple[str, object]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _refused_table(by_reason: dict[str, int]) -> str:
    """Refused files (rejected + quarantined) counted per reason; reasons name checks, never files."""
    if not by_reason:
        return "<p>No files refused.</p>"
    rows = "".join(f"<tr><td>{html.escape(reason)}</td><td>{count}</td></tr>"
                   for reason, count in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0])))
    return ("<h3>Refused files by reason</h3><table class='refused'><tr><th>reason</th><th>files</th></tr>"
            f"{rows}<tr><th>total</th><th>{sum(by_reason.values())}</th></tr></table>")


def smoothed_loss(training: TrainingSummary) -> float | None:
    """Exponential moving average of the logged training losses (span 20 logged steps).

    The last batch's loss is one noisy sample; the smoothed value is what "final loss" should mean."""
    losses = [loss for _, loss in training.curve if _finite(loss)]
    if not losses:
        return training.final_loss if _finite(training.final_loss) else None
    alpha = 2.0 / (min(len(losses), 20) + 1)
    value = losses[0]
    for loss in losses[1:]:
        value = alpha * loss + (1 - alpha) * value
    return value


def _run_rows(result: PipelineResult) -> list[tuple[str, object]]:
    r = result.run
    rows: list[tuple[str, object]] = [
        ("securetrain version", r.securetrain_version or "-"),
        ("source commit", r.source_commit or "- (not a git checkout; set SECURETRAIN_SOURCE_COMMIT)"),
        ("Prefect flow run", r.flow_run_id or "- (--no-prefect)"),
        ("started / finished (UTC)", f"{r.started_at or '-'} / {r.finished_at or '-'}"),
    ]
    if r.stage_seconds:
        rows.append(("stage timings", ", ".join(f"{k} {v:.1f} s" for k, v in r.stage_seconds.items())
                     + f" (total {sum(r.stage_seconds.values()):.1f} s)"))
    changes = r.input_changes
    if changes:
        since = changes["previous_run"] or "- (first run of the series)"
        listed = " ".join(changes["new_sha256"])
        more = changes["new"] - len(changes["new_sha256"])
        rows.append(("scheduled run", f"series {changes['series']}; previous run {since}"))
        rows.append(("inputs new since the previous run (SHA-256)",
                     f"{changes['new']} new of {changes['inputs']}, {changes['removed']} no longer present"
                     + (f": {listed}" if listed else "") + (f" … and {more} more (result.json)" if more > 0 else "")))
    rows.append(("config sha256", result.config_sha256 or "-"))
    keys = sorted({c.key_id for c in result.training.checkpoints if c.key_id})
    rows.append(("checkpoint key ids (KEK, never the key)", ", ".join(keys) or "-"))
    for name, label in (("kek_fingerprint", "KEK fingerprint"), ("deid_key_id", "de-identification key id"),
                        ("audit_public_key_sha256", "audit public key SHA-256")):
        if result.keys.get(name):
            rows.append((label, result.keys[name]))
    if result.keys.get("deid_key_note"):
        rows.append(("DEMO KEY", result.keys["deid_key_note"]))
    if result.provenance and result.provenance.get("keyid"):
        rows.append(("provenance key id", result.provenance["keyid"]))
    if result.masking:
        rows.append(("masking key id", result.masking.key_id))
    return rows


HE_EXPLAINED = (
    "<p><b>Reading these numbers.</b> <i>AUC</i> (area under the ROC curve) measures how well the "
    "scores rank positives above negatives over every possible threshold; it does not depend on a "
    "threshold. <i>Accuracy</i> is the share of correct decisions at one fixed threshold (0.5 on "
    "probabilities, 0 on logits). Encrypted and plaintext values agree when the CKKS noise and the "
    "polynomial approximation (both shown as the max abs error) are small against the distance of the "
    "scores from the threshold; a sample scored near the threshold can flip accuracy while the AUC "
    "barely moves.</p>"
)
HE_REGRESSION_EXPLAINED = (
    "<p><b>Reading these numbers.</b> The data owner decrypts one value per sample and un-standardises it "
    "(output × std + mean, the training split's), so every error here is in the target's units. RMSE and "
    "MAE compare the encrypted and the plaintext model's predictions with the held-out targets; the "
    "encrypted-vs-plaintext RMSE is what encryption added (CKKS noise and the released values' rounding).</p>"
)


def resumed_notice(training: TrainingSummary) -> str:
    """A visible notice when training continued from a checkpoint; louder when nothing was left to train."""
    if training.resumed_from is None:
        return ""
    if training.resumed_from >= training.steps:
        text = (f"This run resumed a finished run (checkpoint at step {training.resumed_from}) and trained no new "
                "steps: its metrics are those of the earlier run. For a new run use a new run name, "
                "`securetrain run --new-run`, or a schedule (each scheduled run has its own folder).")
    else:
        text = (f"Training resumed from the checkpoint at step {training.resumed_from} and continued to step "
                f"{training.steps}.")
    return f'<p class="notice"><b>Resumed.</b> {html.escape(text)}</p>'


def undefined_metric_text(metric: str | None, validation: list[dict[str, Any]] | None,
                          best: dict[str, Any] | None) -> str | None:
    """Why no best checkpoint was kept: the validation metric was undefined (None) at every validation,
    e.g. AUC on a held-out split holding one class. ``None`` when there is nothing to say."""
    if not metric or best or not validation or any(v.get(metric) is not None for v in validation):
        return None
    counts = validation[-1].get("class_counts")
    why = f" (held-out class counts {counts})" if isinstance(counts, list) else ""
    if metric == "auc" and isinstance(counts, list) and sum(1 for c in counts if c) < 2:
        why = f" (AUC needs two classes in the held-out split; its class counts: {counts})"
    return (f"validation metric {metric!r} was undefined at every validation{why}, so no best checkpoint was "
            "kept: HE scoring and the signed provenance use the last weights. Hold out more patients/entities "
            "(data.eval_fraction, or more data) or choose another training.validation.metric (loss, accuracy).")


def undefined_metric_notice(training: TrainingSummary) -> str:
    text = undefined_metric_text(training.validation_metric, training.validation, training.best)
    return f'<p class="notice"><b>No best checkpoint.</b> {html.escape(text[0].upper() + text[1:])}</p>' if text else ""


def colour_notice(training: TrainingSummary) -> str:
    """A visible notice when colour DICOM inputs were averaged into one grey channel."""
    inputs = training.inputs or {}
    converted = int(inputs.get("converted_to_grey") or 0)
    if not converted:
        return ""
    why = (f", as {inputs.get('grey_files')} input file(s) are grey" if inputs.get("requested") == "auto" else "")
    return ('<p class="notice"><b>Colour converted to grey.</b> '
            f"{converted} colour input file(s) converted to one grey channel (the mean of R, G and B; "
            f"data.color_mode: {html.escape(str(inputs.get('requested')))}{html.escape(why)}). "
            "Set data.color_mode: rgb (or auto) to train on three colour channels.</p>")


def _outputs_text(t: TrainingSummary) -> str:
    if t.task_kind == "regression":
        return "regression (one output)"
    return f"classes {', '.join(t.class_names)}"


def _target_scaling_text(t: TrainingSummary) -> str:
    s = t.target_scaling
    if not s:
        return "none: trained on the raw targets"
    return (f"standardised: (target - {s['mean']:.6g}) / {s['std']:.6g}, fitted on {s['samples']} training samples; "
            "the checkpoints output standardised values (prediction = output * std + mean), the released "
            "model.safetensors predicts in the target's units (see the provenance's releasedOutputs); RMSE, MAE and "
            "predictions are in the target's units, the training loss on the standardised scale")


def best_validation(training: TrainingSummary) -> dict[str, Any] | None:
    """The validation entry of the best epoch (else the last one)."""
    if not training.validation:
        return None
    if training.best:
        for v in training.validation:
            if v.get("step") == training.best.get("step") and v.get("epoch") == training.best.get("epoch"):
                return v
    return training.validation[-1]


def _confusion_html(names: list[str], confusion: list[list[int]]) -> str:
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    rows = "".join(
        f"<tr><th>{html.escape(names[i] if i < len(names) else str(i))}</th>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>"
        for i, row in enumerate(confusion)
    )
    return f"<table class='confusion'><tr><th>true \\ predicted</th>{head}</tr>{rows}</table>"


def _data_rows(result: PipelineResult) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    digests: dict[str, str] = {}
    if result.deid:
        digests = result.deid.digests
    elif result.masking:
        digests = result.masking.digests
    for name, value in sorted(digests.items()):
        rows.append((f"sha256 {name}", value))
    return rows


def _mib(value: Any) -> str:
    return f"{value / 2**20:.0f} MiB" if isinstance(value, (int, float)) else str(value)


def _privacy_text(p: dict) -> str:
    replaced = p.get("replaced_layers")  # the trained architecture differs from the model spec's
    return (f"ε = {_num(p.get('epsilon'))} spent of {_num(p.get('target_epsilon'))} at δ = {p.get('delta')} "
            f"({p.get('accountant')} accountant, noise multiplier {_num(p.get('noise_multiplier'))}, "
            f"clip {p.get('max_grad_norm')})"
            + (f"; layers replaced for DP-SGD (trained and saved so): {describe_fix(replaced)}" if replaced else ""))


def _privacy_rows(t: Any) -> list[tuple[str, object]]:
    return [("differential privacy (DP-SGD)", _privacy_text(t.privacy))] if t.privacy else []


def markdown_summary(result: PipelineResult) -> str:
    """The run summary as markdown (used for the Prefect artifact)."""
    t = result.training
    lines = ["# securetrain run", "", "| stage | result |", "| --- | --- |"]
    if result.deid:
        d = result.deid
        lines.append(f"| de-identification | {d.files_out}/{d.files_in} files, {d.tags_changed} tags changed, "
                     f"{d.rejected} rejected, {d.quarantined} quarantined (policy {d.policy} v{d.policy_version})"
                     + (f"; {d.refusal_note()}" if d.refusal_report else "") + " |")
    if result.masking:
        m = result.masking
        lines.append(f"| masking | {m.rows_in} rows, policy {m.policy} v{m.policy_version}; split by `{m.split_by}`: "
                     f"{m.train_entities}/{m.eval_entities} entities train/eval |")
    lines += [
        f"| model | `{t.model_target}`, {t.parameters:,} parameters, {_outputs_text(t)} |",
        f"| training | {t.steps} steps on {t.device}, smoothed loss {_num(smoothed_loss(t))} (last batch "
        f"{t.final_loss:.4f}), {t.samples_per_second:.0f} samples/s ({t.reason}) |",
        f"| checkpoints | {len(t.checkpoints)} encrypted; last key id `{t.checkpoints[-1].key_id if t.checkpoints else '-'}` |",
    ]
    if t.privacy:
        lines.append(f"| differential privacy | {_privacy_text(t.privacy)} |")
    best = best_validation(t)
    if best and t.task_kind == "regression":
        lines.append(f"| validation (best epoch {best['epoch']}) | RMSE {_num(best.get('rmse'))}, MAE "
                     f"{_num(best.get('mae'))}, R² {_num(best.get('r2'))} |")
    elif best:
        lines.append(f"| validation (best epoch {best['epoch']}) | loss {_num(best.get('loss'))}, accuracy "
                     f"{_num(best.get('accuracy'))}, macro AUC {_num(best.get('auc'))} |")
    if result.he:
        h = result.he
        scores = (f"RMSE plain {_num(h.rmse_plaintext)} / encrypted {_num(h.rmse_encrypted)}, encrypted vs plain "
                  f"RMSE {_sci(h.rmse_vs_plaintext)}" if h.task_kind == "regression" else
                  f"AUC plain {_num(h.plaintext_auc)} / encrypted {_num(h.encrypted_auc)}, prediction agreement "
                  f"{_num(h.prediction_agreement)}")
        lines.append(
            f"| HE evaluation ({h.scope}) | {h.samples} samples, max abs error {h.max_abs_error:.2e}, "
            f"{scores}, {h.ms_per_sample:.2f} ms/sample |"
        )
    if result.audit:
        a = result.audit
        lines.append(f"| audit | {a.entries} entries, root `{a.root_hash[:16]}…`, verified: {a.verified} |")
    return "\n".join(lines) + "\n"


def write_html_report(result: PipelineResult, path: Path) -> Path:
    """A single self-contained HTML file (the PNG is embedded) summarising every stage."""
    import base64

    t = result.training
    sections: list[str] = ["<h2>Run</h2>", _table(_run_rows(result))]
    if result.deid:
        d = result.deid
        sections += [
            "<h2>De-identification</h2>",
            _table([
                ("policy", f"{d.policy} (version {d.policy_version})"),
                ("files in / out", f"{d.files_in} / {d.files_out}"),
                ("tags changed", d.tags_changed),
                ("rejected (policy: burned-in text, no patient identity)", d.rejected),
                ("quarantined (could not be processed: unreadable, truncated, not DICOM)", d.quarantined),
                *([("refused files", d.refusal_note())] if d.refusal_report else []),
                ("split (patients train / eval)", f"{d.train_patients} / {d.eval_patients}"),
                ("files train / eval", f"{d.train_files} / {d.eval_files}"),
            ]),
            _refused_table(d.refused_by_reason),
        ]
    if result.masking:
        m = result.masking
        sections += [
            "<h2>Tabular masking</h2>",
            _table([
                ("policy", f"{m.policy} (version {m.policy_version})"),
                ("masking key id", m.key_id),
                ("rows", m.rows_in),
                ("actions", ", ".join(f"{c}: {a}" for c, a in m.columns.items())),
                (f"split by {m.split_by} (entities train / eval)", f"{m.train_entities} / {m.eval_entities}"),
                ("rows train / eval", f"{m.train_rows} / {m.eval_rows}"),
                ("feature columns", ", ".join(m.feature_columns)),
            ]),
        ]
    sections += [
        "<h2>Model card</h2>",
        _table([
            ("model target", t.model_target),
            ("parameters", f"{t.parameters:,}"),
            *([("output", "regression: one value per sample (loss: mean squared error)"),
               ("target scaling", _target_scaling_text(t))]
              if t.task_kind == "regression" else
              [("classes (id: name)", ", ".join(f"{i}: {n}" for i, n in enumerate(t.class_names)))]),
            ("task", result.task),
            ("config sha256", result.config_sha256 or "-"),
            *_data_rows(result),
        ]),
        "<h2>Training</h2>",
        resumed_notice(t),
        undefined_metric_notice(t),
        colour_notice(t),
        _table([
            ("device", t.device),
            ("steps / epochs", f"{t.steps} / {t.epochs_completed}"),
            ("stopped", t.reason),
            ("training loss, smoothed (EMA, span 20 logged steps)", _num(smoothed_loss(t))),
            ("training loss, last logged batch", f"{t.final_loss:.5f}"),
            ("throughput", f"{t.samples_per_second:.1f} samples/s"),
            ("processes", f"{t.world_size} ({t.strategy})"),
            ("device memory (end)", ", ".join(f"{k} {_mib(v)}" for k, v in t.memory.items()) or "-"),
            *_privacy_rows(t),
        ]),
    ]
    if t.profile_trace is not None:
        try:
            href = t.profile_trace.relative_to(result.run_dir).as_posix()
        except ValueError:
            href = t.profile_trace.as_posix()
        sections.append(f"<p>Timeline profile (torch.profiler, Chrome trace): <a href='{html.escape(href, quote=True)}'>"
                        f"{html.escape(t.profile_trace.name)}</a>; open it in ui.perfetto.dev or chrome://tracing.</p>")
    if result.curve_png and result.curve_png.exists():
        png = base64.b64encode(result.curve_png.read_bytes()).decode()
        sections.append(f'<img alt="training and validation curves" src="data:image/png;base64,{png}">')
    if t.validation and t.task_kind == "regression":
        rows = "".join(
            f"<tr><td>{v.get('epoch')}</td><td>{v.get('step')}</td><td>{_num(v.get('rmse'))}</td>"
            f"<td>{_num(v.get('mae'))}</td><td>{_num(v.get('r2'))}</td><td>{_num(v.get('loss'))}</td>"
            f"<td>{html.escape(str(v.get('samples', '-')))}</td></tr>"
            for v in t.validation
        )
        sections.append("<h3>Validation per epoch</h3><table><tr><th>epoch</th><th>step</th><th>RMSE</th>"
                        f"<th>MAE</th><th>R²</th><th>loss (MSE)</th><th>samples</th></tr>{rows}</table>")
    elif t.validation:
        rows = "".join(
            f"<tr><td>{v.get('epoch')}</td><td>{v.get('step')}</td><td>{_num(v.get('loss'))}</td>"
            f"<td>{_num(v.get('accuracy'))}</td><td>{_num(v.get('auc'))}</td>"
            f"<td>{html.escape(str(v.get('class_counts', '-')))}</td></tr>"
            for v in t.validation
        )
        sections.append("<h3>Validation per epoch</h3><table><tr><th>epoch</th><th>step</th><th>loss</th>"
                        f"<th>accuracy</th><th>macro AUC</th><th>class counts</th></tr>{rows}</table>")
    if t.validation and t.best:
        where = t.best_checkpoint.path.name if t.best_checkpoint else "-"
        sections.append(f"<p>Best {html.escape(str(t.best['metric']))}: {_num(t.best.get('value'))} at epoch "
                        f"{t.best.get('epoch')} (encrypted best checkpoint <code>{html.escape(where)}</code>).</p>")
    if t.validation and t.task_kind != "regression":
        best = best_validation(t)
        if best and best.get("confusion"):
            sections.append(f"<h3>Confusion matrix (epoch {best.get('epoch')})</h3>")
            sections.append(_confusion_html(t.class_names, best["confusion"]))
    ckpt_rows = "".join(
        f"<tr><td>{c.step}</td><td>{html.escape(c.path.name)}</td><td><code>{html.escape(c.key_id or '-')}</code></td>"
        f"<td><code>{c.sha256[:16]}…</code></td></tr>"
        for c in t.checkpoints
    )
    sections.append(
        "<h3>Encrypted checkpoints</h3><table><tr><th>step</th><th>file</th><th>key id</th><th>sha256</th></tr>"
        f"{ckpt_rows}</table>"
    )
    if result.he:
        h = result.he
        regression = h.task_kind == "regression"
        scores: list[tuple[str, object]] = [
            ("RMSE plaintext / encrypted (vs the held-out targets)", f"{_num(h.rmse_plaintext)} / {_num(h.rmse_encrypted)}"),
            ("MAE plaintext / encrypted", f"{_num(h.mae_plaintext)} / {_num(h.mae_encrypted)}"),
            ("RMSE of the encrypted vs the plaintext predictions", _sci(h.rmse_vs_plaintext)),
        ] if regression else [
            ("AUC plaintext / encrypted", f"{_num(h.plaintext_auc)} / {_num(h.encrypted_auc)}"),
            ("accuracy plaintext / encrypted", f"{_num(h.plaintext_accuracy)} / {_num(h.encrypted_accuracy)}"),
            ("same predicted class as the plaintext model", _num(h.prediction_agreement)),
        ]
        units = " (target's units; decrypted outputs un-standardised)" if regression else ""
        sections += [
            "<h2>Homomorphic evaluation (CKKS)</h2>",
            _table([
                ("scope", "whole model" if h.scope == "model" else "linear head on data-owner features"),
                ("samples × features", f"{h.samples} × {h.features}"),
                ("encrypted scores per sample", h.outputs),
                (f"max abs error vs the exact model{units}", f"{h.max_abs_error:.3e}"),
                ("of which CKKS noise / polynomial approximation",
                 f"{_sci(h.max_abs_error_vs_plan)} / {_sci(h.approximation_error)}"),
                *scores,
                ("time", f"{h.ms_per_sample:.3f} ms/sample"),
                ("poly modulus degree", h.poly_modulus_degree),
                ("public context size", f"{h.public_context_bytes:,} bytes"),
            ]),
            HE_REGRESSION_EXPLAINED if regression else HE_EXPLAINED,
        ]
    if result.audit:
        a = result.audit
        verdict = "verified" if a.verified else "VERIFICATION FAILED"
        failed = ("" if a.verified else '<p class="notice"><b>Audit verification failed.</b> The standalone '
                  "verifier rejected this run's exported audit log (its output is below); do not rely on this "
                  "run's records until that is explained.</p>")
        sections += [
            "<h2>Audit log</h2>",
            failed,
            _table([
                ("database", a.url),
                ("entries", a.entries),
                ("Merkle root", a.root_hash),
                ("signed checkpoint", a.checkpoint_note),
                ("export", a.export_dir),
                ("standalone verifier", verdict),
            ]),
            f"<pre>{html.escape(a.verifier_output)}</pre>",
        ]
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>securetrain run report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; color: #1b1f24; }}
table {{ border-collapse: collapse; margin: .5rem 0 1rem; }}
th, td {{ border: 1px solid #d0d7de; padding: .3rem .6rem; text-align: left; }}
th {{ background: #f6f8fa; }}
table.confusion td {{ text-align: right; }}
img {{ max-width: 100%; }}
pre {{ background: #f6f8fa; padding: .6rem; overflow-x: auto; }}
</style></head><body>
<h1>securetrain run report</h1>
<p>Run directory: <code>{html.escape(str(result.run_dir))}</code></p>
{''.join(sections)}
</body></html>
"""
    atomic_write_bytes(path, page.encode(), mode=0o644)
    return path
