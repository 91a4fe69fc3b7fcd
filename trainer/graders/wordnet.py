"""WordNet for the meteor metric, found once per process: NLTK's own data (``nltk.data.path``, e.g.
``.venv/share/nltk_data/corpora/wordnet``, which ``scripts/bootstrap.sh`` lays out from Debian's
``wordnet-base``), else none: meteor is then refused at validation and flagged at grade time."""

from __future__ import annotations

import functools
import warnings
from typing import Any

UNAVAILABLE = (
    "meteor needs WordNet, and this server has none: run scripts/bootstrap.sh as root (it installs Debian's "
    "wordnet-base into .venv/share/nltk_data), or `python -m nltk.downloader wordnet`"
)


@functools.cache
def wordnet() -> Any | None:
    """NLTK's WordNet reader, or None when no WordNet data is installed."""
    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    try:
        root = nltk.data.find("corpora/wordnet")
    except LookupError:
        return None
    with (
        warnings.catch_warnings()
    ):  # "multilingual functions are not available": no Open Multilingual Wordnet
        warnings.simplefilter("ignore")
        return WordNetCorpusReader(root, None)


def available() -> bool:
    return wordnet() is not None
