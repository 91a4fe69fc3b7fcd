"""The GPU check's report: the headline table, one JSON of every section, and a PNG chart.

    python -m bench.gpu_report --out DIR --headline   # the headline table (DIR/gpu_check.json)
    python -m bench.gpu_report --out DIR              # DIR/gpu_check_summary.json + DIR/gpu_check.png

``bench/gpu_check.sh`` writes one JSON per section into DIR (``preflight.json``, ``gpu_check.json``
for the headline, ``engine_ops_bf16.json``, ...). This module reads what is there (a section that
failed or was cut by the deadline is listed as missing, with its log's last line) and prints the
headline ratios first: zenflow's steps/s against offload and device, each mode's stall fraction and
NVML GPU utilization, and zenflow's held-out loss against device's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

#: The sections bench/gpu_check.sh runs, in its order: (file stem, what it measures).
SECTIONS: list[tuple[str, str]] = [
    ("gpu_check", "headline: 1B-class Llama, bf16, zenflow vs device vs offload"),
    ("gpu_check_extra", "headline variants run after the other sections (zenflow-dacc)"),
    ("distributed", "NCCL ranks vs one process (2 or more GPUs only)"),
    ("engine_ops_bf16", "host syncs, launches per step, reselection, bad gradients (bf16)"),
    ("engine_ops_fp16", "fp16 loss scaling, a reselection every window"),
    ("gil_small", "CPU worker's GIL hold per step"),
    ("cpu_adam", "C++ CPU AdamW and window accumulation vs torch"),
    ("memory_run", "the plan's step time and memory vs a short real run"),
]


def headline_doc(out_dir: Path) -> dict[str, Any] | None:
    """The headline's document, with the variants run after the other sections (``gpu_check_extra.json``:
    zenflow-dacc, when time was left) merged in."""
    head = _load(out_dir / "gpu_check.json")
    extra = _load(out_dir / "gpu_check_extra.json")
    if head is None or not extra:
        return head
    for name, r in extra.get("results", {}).items():
        head["results"].setdefault(name, r)
    for k, v in extra.get("ratios", {}).items():
        head["ratios"].setdefault(k, v)
    for k, v in extra.get("targets", {}).items():
        head["targets"].setdefault(k, v)
    return head


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


def headline_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant of bench/engine.py's document, zenflow's first."""
    rows = []
    for name, r in doc.get("results", {}).items():
        rows.append(
            {
                "variant": name,
                "steps": r["steps"],
                "steps_per_s": r["steps_per_s"],
                "stall_fraction": r["stall_fraction"],
                "gpu_util_percent": r.get("gpu_util_percent"),
                "final_loss": r["final_loss"],
                "peak_device_memory_gib": r.get("peak_device_memory_gib"),
            }
        )
    return rows


def headline_text(doc: dict[str, Any]) -> str:
    env = doc.get("env", {})
    out = [
        f"HEADLINE: {env.get('model_size', '?')} Llama ({env.get('params', 0) / 1e9:.2f}B params, "
        f"{env.get('dtype', '?')}) on {env.get('device_name', '?')}, batch {env.get('batch')}x{env.get('seq')}, "
        f"topk {env.get('topk_ratio')}, update_interval {env.get('update_interval')}, torch {env.get('torch')}",
        f"{'variant':<13} {'steps':>5} {'steps/s':>8} {'stall':>7} {'GPU util':>8} {'held-out loss':>13} {'peak GiB':>8}",
    ]
    for r in headline_rows(doc):
        util = "n/a" if r["gpu_util_percent"] is None else f"{r['gpu_util_percent']:.0f}%"
        peak = "n/a" if r["peak_device_memory_gib"] is None else f"{r['peak_device_memory_gib']:.1f}"
        out.append(
            f"{r['variant']:<13} {r['steps']:>5} {r['steps_per_s']:>8.3f} {r['stall_fraction']:>7.1%} "
            f"{util:>8} {r['final_loss']:>13.4f} {peak:>8}"
        )
    for k, v in doc.get("ratios", {}).items():
        out.append(f"  {k}: {v:.3f}")
    for k, ok in doc.get("targets", {}).items():
        out.append(f"  target {k}: {'PASS' if ok else 'FAIL'}")
    pending = doc.get("variants_pending") or []
    if pending:
        out.append(f"  not run (deadline or failure): {', '.join(pending)}")
    return "\n".join(out)


def summary(out_dir: Path) -> dict[str, Any]:
    """Every section's document (or why it is missing), the preflight, and the headline rows."""
    doc: dict[str, Any] = {"preflight": _load(out_dir / "preflight.json"), "sections": {}}
    for stem, what in SECTIONS:
        data = _load(out_dir / f"{stem}.json")
        if data is None:
            doc["sections"][stem] = {
                "what": what,
                "status": "missing",
                "log_tail": _last_line(out_dir / f"{stem}.log"),
            }
        else:
            doc["sections"][stem] = {"what": what, "status": "ok", "data": data}
    head = headline_doc(out_dir)
    doc["headline"] = (
        {"rows": headline_rows(head), "ratios": head.get("ratios", {}), "targets": head.get("targets", {})}
        if head
        else None
    )
    return doc


def chart(doc: dict[str, Any], path: Path) -> str:
    """A PNG of the headline (steps/s, stall fraction, GPU utilization per variant); '' or why not."""
    if not doc.get("headline") or not doc["headline"]["rows"]:
        return "no headline to chart"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed"
    rows = doc["headline"]["rows"]
    names = [r["variant"] for r in rows]
    panels = [
        ("steps/s", [r["steps_per_s"] for r in rows]),
        ("stall fraction (%)", [100 * r["stall_fraction"] for r in rows]),
    ]
    if any(r["gpu_util_percent"] is not None for r in rows):
        panels.append(("GPU utilization, NVML (%)", [r["gpu_util_percent"] or 0.0 for r in rows]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (title, values) in zip(axes[0], panels, strict=True):
        ax.bar(names, values, color=["#3b7dd8" if n.startswith("zenflow") else "#999999" for n in names])
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the folder bench/gpu_check.sh wrote its sections into")
    ap.add_argument("--headline", action="store_true", help="print only the headline table")
    ap.add_argument("--quiet", action="store_true", help="write the summary, print nothing")
    ap.add_argument("--no-chart", action="store_true", help="no PNG (faster: no matplotlib import)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    head = headline_doc(out_dir)
    if args.headline:
        if head is None:
            print(
                f"no headline: {out_dir / 'gpu_check.json'} missing ({_last_line(out_dir / 'gpu_check.log')})"
            )
            return 1
        print(headline_text(head))
        return 0
    doc = summary(out_dir)
    why = "not asked for (--no-chart)" if args.no_chart else chart(doc, out_dir / "gpu_check.png")
    doc["chart"] = "gpu_check.png" if not why else f"none: {why}"
    (out_dir / "gpu_check_summary.json").write_text(json.dumps(doc, indent=2), encoding="utf-8")
    if args.quiet:
        return 0
    if head is not None:
        print(headline_text(head))
    for stem, sec in doc["sections"].items():
        line = f"  {stem}: {sec['status']}"
        if sec["status"] != "ok" and sec.get("log_tail"):
            line += f" ({sec['log_tail']})"
        print(line)
    print(f"summary: {out_dir / 'gpu_check_summary.json'}; chart: {doc['chart']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
