#!/usr/bin/env bash
# WordNet for the meteor metric of the text_similarity grader (trainer/graders/wordnet.py), laid out where
# NLTK looks: scripts/wordnet_layout.sh DIR (DIR: an nltk_data folder, e.g. .venv/share/nltk_data). From
# Debian's wordnet-base and wordnet-sense-index, installed by the caller (scripts/bootstrap.sh, the
# Dockerfile): their files copied into DIR/corpora/wordnet (NLTK refuses links that lead out of its data
# root), and the lexnames table NLTK's reader opens, which Debian ships only in the lexnames(5WN) page.
set -euo pipefail
target="${1:?usage: scripts/wordnet_layout.sh NLTK_DATA_DIR}/corpora/wordnet"
mkdir -p "$target"
cp -f /usr/share/wordnet/* "$target"/
zcat /usr/share/man/man5/lexnames.5WN.gz | awk -F'\t' '
  /^[0-9][0-9]\t/ { split($2, n, "."); c = (n[1] == "noun") ? 1 : (n[1] == "verb") ? 2 : (n[1] == "adj") ? 3 : 4
                    gsub(/ /, "", $2); printf "%s\t%s\t%d\n", $1, $2, c }' >"$target/lexnames.tmp"
lines="$(wc -l <"$target/lexnames.tmp")"
[ "$lines" -eq 45 ] || { echo "wordnet_layout: lexnames(5WN) gave $lines lexicographer files, not 45" >&2; exit 1; }
mv "$target/lexnames.tmp" "$target/lexnames"
