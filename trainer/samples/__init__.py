"""Sample data and specs shipped with the package (demo and tests)."""

from pathlib import Path

SAMPLES_DIR = Path(__file__).resolve().parent
TRAIN_FILE = SAMPLES_DIR / "capitals_train.jsonl"
VALID_FILE = SAMPLES_DIR / "capitals_valid.jsonl"
SPEC_FILE = SAMPLES_DIR / "tiny-llama.yaml"
#: Model root of the demo's base (trainer.samples.demo_base; its folder: MODELS_DIR / "docs-llama").
MODELS_DIR = SAMPLES_DIR / "models"
