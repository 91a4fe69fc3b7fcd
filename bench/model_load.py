"""Peak host memory while loading a base model (issue 12: weights onto the device without a full host copy).

    python -m bench.model_load                          # ~110M-parameter Llama, bf16, 50 MB shards, on cpu
    python -m bench.model_load --device cuda --json     # on a GPU host: peak RSS ~ one shard beyond the process

Writes a randomly initialised Llama-shaped model (``--hidden``, ``--layers``, vocab 32000) as sharded
safetensors into a temporary folder, then loads it with ``trainer.model.catalog.load_model`` in a fresh
process on ``--device`` and reports that process's RSS before the load (torch, transformers and, on
CUDA, the CUDA context) and, sampled every 5 ms through the load and a first read of every weight,
the peak RSS and the peak growth of its anonymous memory and of its mapped-file pages, beside the
model's bytes and the largest shard's (``ru_maxrss`` is no use here: Linux carries the parent's peak
into the child). transformers maps every safetensors shard for the whole load: on a CPU device the
weights stay file-backed pages of those maps (read on first use, no anonymous copy); on CUDA the pages
read stay resident as page cache until the maps close at the end of the load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _rss() -> dict[str, int]:
    """Resident bytes of this process: all (VmRSS), anonymous (RssAnon) and file-backed (RssFile:
    mapped safetensors pages, reclaimable page cache)."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class _Sampler(threading.Thread):
    """Polls :func:`_rss` every few milliseconds and keeps each figure's peak."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak: dict[str, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.005):
            for k, v in _rss().items():
                self.peak[k] = max(self.peak.get(k, 0), v)


def write_model(folder: Path, *, hidden: int, layers: int, dtype: str, shard: str) -> dict[str, int]:
    """A random Llama-shaped model saved as safetensors shards; its size and the largest shard's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(folder, max_shard_size=shard, safe_serialization=True)
    shards = sorted(folder.glob("*.safetensors"))
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "largest_shard_bytes": max(s.stat().st_size for s in shards),
        "shards": len(shards),
    }


def child(folder: str, device: str, dtype: str) -> dict[str, Any]:
    """Runs in a fresh process: RSS before and peak during ``load_model``."""
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  # imports count before the load, not in it
    from transformers import AutoModelForCausalLM  # noqa: F401

    from trainer.model.catalog import load_model

    if device == "cuda":
        torch.empty(1, device="cuda")  # so does the CUDA context
    before = _rss()
    sampler = _Sampler()
    sampler.start()
    model = load_model(folder, dtype=getattr(torch, dtype), seed=0, device=device)
    with torch.no_grad():  # first use: every weight read once (a CPU load may leave them mapped, unread)
        for p in model.parameters():
            p.sum()
    sampler.stop.set()
    sampler.join()
    after = _rss()
    return {
        "rss_before_bytes": before["VmRSS"],
        "peak_rss_bytes": sampler.peak.get("VmRSS", 0),
        "after_rss_bytes": after["VmRSS"],
        "anon_growth_bytes": sampler.peak.get("RssAnon", 0) - before.get("RssAnon", 0),
        "file_growth_bytes": sampler.peak.get("RssFile", 0) - before.get("RssFile", 0),
        "device": str(next(model.parameters()).device),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--shard", default="50MB", help="max_shard_size of the saved model")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.device, args.dtype)))
        return 0
    with tempfile.TemporaryDirectory(prefix="zenflow-model-load-") as tmp:
        info = write_model(
            Path(tmp), hidden=args.hidden, layers=args.layers, dtype=args.dtype, shard=args.shard
        )
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.model_load",
                "--child",
                tmp,
                "--device",
                args.device,
                "--dtype",
                args.dtype,
            ],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
    res = {**info, **json.loads(out.stdout.strip().splitlines()[-1]), "device_arg": args.device}
    res["load_growth_bytes"] = res["peak_rss_bytes"] - res["rss_before_bytes"]
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(
            f"{res['params'] / 1e6:.0f}M params, {res['model_bytes'] / MiB:.0f} MiB in {res['shards']} shards "
            f"(largest {res['largest_shard_bytes'] / MiB:.0f} MiB), loaded on {res['device']}: RSS "
            f"{res['rss_before_bytes'] / MiB:.0f} MiB before, peak {res['peak_rss_bytes'] / MiB:.0f} MiB "
            f"(+{res['load_growth_bytes'] / MiB:.0f} MiB: anonymous +{res['anon_growth_bytes'] / MiB:.0f}, "
            f"mapped files +{res['file_growth_bytes'] / MiB:.0f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
