"""WordNet for meteor as bootstrap and the image lay it out (scripts/wordnet_layout.sh): from Debian's
wordnet-base into an nltk_data folder that NLTK's reader opens, with the 45-row lexnames table; and the
image runs the same script into a folder on NLTK's search path for its interpreter (prefix /usr/local)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "wordnet_layout.sh"


@pytest.mark.skipif(
    not Path("/usr/share/wordnet/index.sense").exists(),
    reason="Debian's wordnet-base (bootstrap installs it)",
)
def test_the_layout_is_a_wordnet_nltk_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    subprocess.run(["bash", str(SCRIPT), str(tmp_path)], check=True, timeout=120)
    root = tmp_path / "corpora" / "wordnet"
    assert len((root / "lexnames").read_text().splitlines()) == 45
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # only this folder: NLTK finds it there
    reader = WordNetCorpusReader(nltk.data.find("corpora/wordnet"), None)
    assert "car" in {lemma.name() for s in reader.synsets("automobile") for lemma in s.lemmas()}


def test_the_image_lays_it_out_where_its_nltk_looks() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"wordnet-base\s+wordnet-sense-index", text)
    assert "--path-include=/usr/share/man/man5/lexnames.5WN.gz" in text  # the slim image drops man pages
    assert "bash scripts/wordnet_layout.sh /usr/local/share/nltk_data" in text
    assert re.search(r"FROM python:\$\{PYTHON_VERSION\}-slim", text)  # sys.prefix /usr/local: on NLTK's path
