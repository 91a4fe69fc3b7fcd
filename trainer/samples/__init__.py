"""Sample data and specs shipped with the package (demo and tests)."""

from pathlib import Path
from typing import Any

SAMPLES_DIR = Path(__file__).resolve().parent
TRAIN_FILE = SAMPLES_DIR / "capitals_train.jsonl"
VALID_FILE = SAMPLES_DIR / "capitals_valid.jsonl"
SPEC_FILE = SAMPLES_DIR / "tiny-llama.yaml"
#: Model root of the demo's base (trainer.samples.demo_base; its folder: MODELS_DIR / "docs-llama").
MODELS_DIR = SAMPLES_DIR / "models"
#: The reinforcement sample's task (keyword-rl.yaml, keyword_rl_*.jsonl): the completion uses the word
#: its row names.
KEYWORD_TRAIN_FILE = SAMPLES_DIR / "keyword_rl_train.jsonl"
KEYWORD_GRADER: dict[str, Any] = {
    "type": "string_check",
    "name": "uses the word",
    "input": "{{sample.output_text}}",
    "reference": "{{item.keyword}}",
    "operation": "ilike",
}
