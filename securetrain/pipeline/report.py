"""Human-facing outputs of a run: a PNG training curve and a self-contained HTML report."""

from __future__ import annotations

import html
from pathlib import Path

from securetrain.io.atomic import atomic_write_bytes
from securetrain.pipeline.results import PipelineResult, TrainingSummary


def plot_training_curve(training: TrainingSummary, path: Path) -> Path:
    """Write the loss curve as a PNG (matplotlib's Agg backend: no display needed)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if training.curve:
        steps, losses = zip(*training.curve)
        ax.plot(steps, losses, color="#1f6feb", linewidth=1.8, label="training loss")
        for ckpt in training.checkpoints:
            ax.axvline(ckpt.step, color="#999999", linewidth=0.8, linestyle=":")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(f"Training loss on {training.device} (dotted: encrypted checkpoints)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue(), mode=0o644)
    return path


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _table(rows: list[tuple[str, object]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def markdown_summary(result: PipelineResult) -> str:
    """The run summary as markdown (used for the Prefect artifact)."""
    t, d = result.training, result.deid
    lines = [
        "# securetrain run",
        "",
        "| stage | result |",
        "| --- | --- |",
        f"| de-identification | {d.files_out}/{d.files_in} files, {d.tags_changed} tags changed, "
        f"{d.rejected} rejected, {d.quarantined} quarantined (policy {d.policy} v{d.policy_version}) |",
        f"| training | {t.steps} steps on {t.device}, final loss {t.final_loss:.4f}, {t.samples_per_second:.0f} samples/s |",
        f"| checkpoints | {len(t.checkpoints)} encrypted; last key id `{t.checkpoints[-1].key_id if t.checkpoints else '-'}` |",
    ]
    if result.he:
        h = result.he
        lines.append(
            f"| HE evaluation | {h.samples} samples, max abs error {h.max_abs_error:.2e}, "
            f"AUC plain {_num(h.plaintext_auc)} / encrypted {_num(h.encrypted_auc)}, {h.ms_per_sample:.2f} ms/sample |"
        )
    if result.audit:
        a = result.audit
        lines.append(f"| audit | {a.entries} entries, root `{a.root_hash[:16]}…`, verified: {a.verified} |")
    return "\n".join(lines) + "\n"


def write_html_report(result: PipelineResult, path: Path) -> Path:
    """A single self-contained HTML file (the PNG is embedded) summarising every stage."""
    import base64

    t, d = result.training, result.deid
    sections = [
        "<h2>De-identification</h2>",
        _table(
            [
                ("policy", f"{d.policy} (version {d.policy_version})"),
                ("files in / out", f"{d.files_in} / {d.files_out}"),
                ("tags changed", d.tags_changed),
                ("rejected (burned-in annotation)", d.rejected),
                ("quarantined (unreadable)", d.quarantined),
            ]
        ),
        "<h2>Training</h2>",
        _table(
            [
                ("device", t.device),
                ("steps / epochs", f"{t.steps} / {t.epochs_completed}"),
                ("final loss", f"{t.final_loss:.5f}"),
                ("throughput", f"{t.samples_per_second:.1f} samples/s"),
            ]
        ),
    ]
    if result.curve_png and result.curve_png.exists():
        png = base64.b64encode(result.curve_png.read_bytes()).decode()
        sections.append(f'<img alt="training curve" src="data:image/png;base64,{png}">')
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
        sections += [
            "<h2>Homomorphic evaluation (CKKS)</h2>",
            _table(
                [
                    ("samples × features", f"{h.samples} × {h.features}"),
                    ("max abs error vs plaintext", f"{h.max_abs_error:.3e}"),
                    ("AUC plaintext / encrypted", f"{_num(h.plaintext_auc)} / {_num(h.encrypted_auc)}"),
                    ("accuracy plaintext / encrypted", f"{_num(h.plaintext_accuracy)} / {_num(h.encrypted_accuracy)}"),
                    ("time", f"{h.ms_per_sample:.3f} ms/sample"),
                    ("poly modulus degree", h.poly_modulus_degree),
                    ("public context size", f"{h.public_context_bytes:,} bytes"),
                ]
            ),
        ]
    if result.audit:
        a = result.audit
        verdict = "verified" if a.verified else "VERIFICATION FAILED"
        sections += [
            "<h2>Audit log</h2>",
            _table(
                [
                    ("database", a.url),
                    ("entries", a.entries),
                    ("Merkle root", a.root_hash),
                    ("signed checkpoint", a.checkpoint_note),
                    ("export", a.export_dir),
                    ("standalone verifier", verdict),
                ]
            ),
            f"<pre>{html.escape(a.verifier_output)}</pre>",
        ]
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>securetrain run report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; color: #1b1f24; }}
table {{ border-collapse: collapse; margin: .5rem 0 1rem; }}
th, td {{ border: 1px solid #d0d7de; padding: .3rem .6rem; text-align: left; }}
th {{ background: #f6f8fa; }}
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
