"""The text_similarity metrics over two strings, each in [0, 1], from well-kept libraries: rapidfuzz
(fuzzy_match: its normalized Indel similarity), NLTK (bleu, gleu, meteor) and Google's rouge-score
(rouge_1 to rouge_5, rouge_l: the F-measure).

Words are ``\\w+`` runs and punctuation marks (NLTK's ``wordpunct_tokenize``, no data files); BLEU is
the sentence BLEU-4 re-weighted for texts under four words and smoothed (Chen and Cherry's method 1)
so that one missing 4-gram does not zero it; ROUGE reads lower-cased words, unstemmed.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from nltk.tokenize import wordpunct_tokenize
from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
from nltk.translate.gleu_score import sentence_gleu
from rapidfuzz import fuzz

from trainer.graders import wordnet

Metric = Callable[[str, str], float]
ROUGE_TYPES = {f"rouge_{n}": f"rouge{n}" for n in range(1, 6)} | {"rouge_l": "rougeL"}


class MetricUnavailable(Exception):
    """The metric needs something this server lacks (WordNet for meteor)."""


def fuzzy_match(text: str, reference: str) -> float:
    return float(fuzz.ratio(text, reference)) / 100.0


def bleu(text: str, reference: str) -> float:
    hyp, ref = wordpunct_tokenize(text), wordpunct_tokenize(reference)
    if not hyp or not ref:
        return float(hyp == ref)
    smooth = SmoothingFunction().method1
    return float(sentence_bleu([ref], hyp, smoothing_function=smooth, auto_reweigh=True))


def gleu(text: str, reference: str) -> float:
    hyp, ref = wordpunct_tokenize(text), wordpunct_tokenize(reference)
    if not hyp or not ref:
        return float(hyp == ref)
    return float(sentence_gleu([ref], hyp))


def meteor(text: str, reference: str) -> float:
    from nltk.translate.meteor_score import meteor_score

    reader = wordnet.wordnet()
    if reader is None:
        raise MetricUnavailable(wordnet.UNAVAILABLE)
    hyp, ref = wordpunct_tokenize(text), wordpunct_tokenize(reference)
    if not hyp or not ref:
        return float(hyp == ref)
    return float(meteor_score([ref], hyp, wordnet=reader))


class _Words:
    """rouge-score's tokenizer interface: lower-cased ``\\w+`` runs, any script (its own keeps a-z0-9 only)."""

    def tokenize(self, text: str) -> list[str]:
        return re.findall(r"\w+", text.lower())


@functools.cache
def _rouge_scorer(rouge_type: str) -> Any:
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer([rouge_type], use_stemmer=False, tokenizer=_Words())


def rouge(metric: str) -> Metric:
    rouge_type = ROUGE_TYPES[metric]

    def score(text: str, reference: str) -> float:
        return float(_rouge_scorer(rouge_type).score(reference, text)[rouge_type].fmeasure)

    return score


METRICS: dict[str, Metric] = {
    "fuzzy_match": fuzzy_match,
    "bleu": bleu,
    "gleu": gleu,
    "meteor": meteor,
    **{name: rouge(name) for name in ROUGE_TYPES},
}
