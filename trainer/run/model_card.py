"""The model card (``README.md``) of an exported model and of its LoRA adapter, and the base it names.

A model or adapter leaves the service with a card others can use: YAML front matter as the Hugging
Face Hub reads it (``base_model``, ``library_name`` ``transformers`` or ``peft``, ``tags``,
``pipeline_tag``), then how it was trained: the base (the API's model id, and for a local folder the
SHA-256 of its ``config.json`` so that others can tell they have the same base), the data (examples,
tokens trained), the hyperparameters the run used and the final training and validation losses.

:func:`base_model_id` is the name written as the adapter's ``base_model_name_or_path``: the id the
API knows the base by (``JobSpec.model_name``), never a server path.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from trainer.spec import JobSpec

CARD_FILE = "README.md"
#: How the card says a method trained the model.
TRAINED_WITH = {
    "supervised": "supervised fine-tuning (chat examples, loss on the assistant's turns)",
    "dpo": "direct preference optimization (DPO: preferred and non-preferred answers to the same prompts)",
    "reinforcement": "reinforcement fine-tuning (GRPO: sampled completions rewarded by a grader)",
}
#: Tags every card carries (plus ``lora`` for adapters).
TAGS = ("zenflow", "fine-tuned", "text-generation")


def base_model_id(spec: JobSpec) -> str:
    """The base model's name for others: the API's id (``spec.model_name``), else the spec's model
    when it is not a path (a built-in name), else the folder's name."""
    if spec.model_name:
        return spec.model_name
    path = Path(spec.model)
    return path.name if path.is_absolute() else spec.model


def base_config_sha256(spec: JobSpec) -> str | None:
    """SHA-256 (hex) of a local base folder's ``config.json``; None for a built-in config."""
    config = Path(spec.model) / "config.json"
    try:
        return hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
    except OSError:
        return None


def _yaml_scalar(value: Any) -> str:
    """A YAML scalar (JSON's spelling is valid YAML for strings, numbers, booleans and null)."""
    return json.dumps(value)


def _loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def model_card(
    spec: JobSpec,
    *,
    adapter: bool,
    hyperparameters: dict[str, Any],
    figures: dict[str, Any],
    train_examples: int,
    valid_examples: int,
    total_steps: int | None = None,
) -> str:
    """The README.md of the exported model (``adapter=False``) or of its LoRA adapter.

    ``figures`` are the run's (trainer.run.outputs.metrics: step, train_loss, train_mean_loss,
    valid_loss, trained_tokens)."""
    base, digest = base_model_id(spec), base_config_sha256(spec)
    seed = hyperparameters.get("seed", spec.hyperparameters.seed)
    download = f"GET /v1/models/{base}/content" + ("" if digest else f"?seed={seed}")
    what = "LoRA adapter" if adapter else "Fine-tuned model"
    body = [
        "",
        f"# {what} of {base}",
        "",
        f"Trained with {TRAINED_WITH.get(spec.method.type, spec.method.type)} by the ZenFlow fine-tuning service."
        + (" The adapter's weights are on top of the base model below." if adapter else ""),
        "",
        "## Base model",
        "",
        _base_line(base, digest, seed, download),
        "",
        "## Training data",
        "",
        f"- Training examples: {train_examples}",
        f"- Validation examples: {valid_examples}",
        f"- Tokens trained: {figures.get('trained_tokens')}",
        "",
        "## Hyperparameters",
        "",
        *(f"- {k}: {_yaml_scalar(v)}" for k, v in sorted(hyperparameters.items()) if v is not None),
        "",
        "## Results",
        "",
        *_results(figures, total_steps),
        "",
        "## Use",
        "",
        *_usage(adapter, base, download),
        "",
    ]
    return "\n".join(_front_matter(adapter, base, digest) + body)


def _front_matter(adapter: bool, base: str, digest: str | None) -> list[str]:
    """The YAML front matter the Hugging Face Hub reads."""
    tags = [*TAGS, "lora"] if adapter else list(TAGS)
    front = [
        "---",
        f"base_model: {_yaml_scalar(base)}",
        f"library_name: {'peft' if adapter else 'transformers'}",
        "pipeline_tag: text-generation",
        "tags:",
        *(f"- {t}" for t in tags),
    ]
    if digest:
        front.append(f"base_model_config_sha256: {_yaml_scalar(digest)}")
    front.append("---")
    return front


def _base_line(base: str, digest: str | None, seed: Any, download: str) -> str:
    base_line = f"- Base model: `{base}`"
    base_line += (
        f" (config.json SHA-256 `{digest}`)" if digest else f" (built-in random-init config, seed {seed})"
    )
    return base_line + f"; download it from the service: `{download}`"


def _results(figures: dict[str, Any], total_steps: int | None) -> list[str]:
    step = figures.get("step")
    steps = f"{step} of {total_steps}" if total_steps else f"{step}"
    return [
        f"- Steps: {steps}",
        f"- Final training loss: {_loss(figures.get('train_loss'))} (mean of the last steps: "
        f"{_loss(figures.get('train_mean_loss'))})",
        f"- Final validation loss: {_loss(figures.get('valid_loss'))}",
    ]


def _usage(adapter: bool, base: str, download: str) -> list[str]:
    """How to load it with transformers (and peft for an adapter)."""
    if adapter:
        return [
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'base = AutoModelForCausalLM.from_pretrained("path/to/{base}")  # from {download}',
            'model = PeftModel.from_pretrained(base, "path/to/this/adapter")',
            "```",
        ]
    return [
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/model")',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/model")',
        "```",
    ]
