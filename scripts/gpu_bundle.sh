#!/usr/bin/env bash
# Build .gpu_bundle/: what scripts/gpu_check.sh needs on a GPU machine that has Python and torch but nothing
# of ours and no network. Run it here (with pip's network and an etcd binary), then carry the folder (it is
# git-ignored) with the working tree:
#
#   bash scripts/gpu_bundle.sh                        # cp312 / manylinux x86_64 wheels (the GPU image's Python)
#   bash scripts/gpu_bundle.sh --python-version 3.11  # for another interpreter (a CPU dry run here)
#   bash scripts/gpu_bundle.sh --with-s3              # + s3fs and moto (the S3 test params; ~25 MiB more)
#   bash scripts/gpu_bundle.sh --requirements 'python3-etcd3'   # only these (and what they need), for tests
#   bash scripts/gpu_bundle.sh --out DIR              # elsewhere than .gpu_bundle
#
# Contents: wheels/ (a wheel of the project, `pip wheel --no-deps .`, and the binary wheels of its runtime
# dependencies, without torch and what torch itself depends on, plus pytest and pytest-timeout), etcd.gz (the
# etcd server binary, gzipped), MANIFEST.txt (Python version, platform, commit, etcd version, files).
# It prints what it put there and the total size, and warns above 60 MiB (the carry limit is 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=.gpu_bundle
PYV=3.12
WITH_S3=0
REQUIREMENTS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --python-version) PYV=$2; shift 2 ;;
    --with-s3) WITH_S3=1; shift ;;
    --requirements) REQUIREMENTS=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "gpu_bundle: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
ETCD=${ETCD_BINARY:-$(command -v etcd || true)}
if [ -z "$ETCD" ] || [ ! -x "$ETCD" ]; then
  echo "gpu_bundle: no etcd binary on PATH (apt-get install etcd-server, or set ETCD_BINARY)" >&2
  exit 1
fi
quiet_pip() { "$PY" -m pip "$@" 2> >(grep -vE "^WARNING: Location" >&2); }

# what the GPU machine's torch image lacks: the project's runtime dependencies (pyproject.toml) but torch,
# and the test runner (the [test] extra's pytest and pytest-timeout)
if [ -z "$REQUIREMENTS" ]; then
  REQUIREMENTS=$("$PY" - <<'EOF'
import re
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
name = lambda spec: re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0].lower()
keep = [s for s in project["dependencies"] if name(s) != "torch"]
keep += [s for s in project["optional-dependencies"]["test"] if name(s) in ("pytest", "pytest-timeout")]
print(" ".join(s.replace(" ", "") for s in keep))
EOF
)
  if [ "$WITH_S3" = 1 ]; then REQUIREMENTS="$REQUIREMENTS s3fs>=2024.2 moto[s3]>=5 flask flask-cors"; fi
fi

rm -rf "$OUT"
mkdir -p "$OUT/wheels"
echo "gpu_bundle: the project's wheel"
quiet_pip wheel -q --no-deps -w "$OUT/wheels" .
echo "gpu_bundle: cp${PYV/./} manylinux x86_64 wheels of: $REQUIREMENTS"
platforms=()  # pip does not widen a --platform to the older manylinux tags: each is named
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
# shellcheck disable=SC2086  # the requirements are words
quiet_pip download -q --only-binary=:all: --python-version "$PYV" --implementation cp "${platforms[@]}" \
  -d "$OUT/wheels" $REQUIREMENTS
# torch's own dependencies are in any torch image: not carried (but typing_extensions, which grpcio imports:
# 45 kB, so that the bundle works on its own, and the image's is kept when it is as new)
for dist in filelock sympy mpmath networkx jinja2 markupsafe setuptools; do
  rm -f "$OUT/wheels/${dist}"-[0-9]*.whl "$OUT/wheels/${dist^}"-[0-9]*.whl
done

echo "gpu_bundle: etcd from $ETCD"
gzip -9 -c "$ETCD" >"$OUT/etcd.gz"
{
  echo "python: $PYV (cp${PYV/./}, manylinux_2_28 x86_64)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
  glibc="?"
  if command -v objdump >/dev/null; then
    glibc=$(objdump -T "$ETCD" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 | cut -d_ -f2)
  fi
  echo "etcd: $("$ETCD" --version | head -1) (needs glibc >= ${glibc:-?})"
  echo "requirements: $REQUIREMENTS"
  echo "files:"
  (cd "$OUT" && find . -type f ! -name MANIFEST.txt -printf '%s %p\n' | sort -k2)
} >"$OUT/MANIFEST.txt"

cat "$OUT/MANIFEST.txt"
bytes=$(du -sb "$OUT" | cut -f1)
echo "gpu_bundle: $(find "$OUT/wheels" -name '*.whl' | wc -l) wheels + etcd in $OUT: $((bytes / 1048576)) MiB ($bytes bytes)"
if [ "$bytes" -gt $((60 * 1048576)) ]; then
  echo "gpu_bundle: WARNING: over 60 MiB; the device machine carries at most 64 MiB with the working tree" >&2
fi
