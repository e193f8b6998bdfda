#!/usr/bin/env bash
# make gpu-check-bundle: the wheels bench/gpu_check.py needs on a GPU machine without network
# (requirements/gpu-check.txt, for CPython 3.12 on x86-64 Linux), into build/gpu-wheels; refuses a
# bundle over 60 MB, the most a lent machine's working tree takes with room for the sources.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${GPU_WHEELS:-build/gpu-wheels}
py=${GPU_PYTHON_VERSION:-3.12}
mkdir -p "$out"
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
  manylinux_2_24 manylinux_2_17 manylinux2014; do
  platforms+=(--platform "${tag}_x86_64")
done
grep -v '^#' requirements/gpu-check.txt | grep -v '^$' > "$out/.wanted"
# --no-deps: the list is complete (each wheel's requirements are either in it or on the machine)
python3 -m pip download -q --no-deps --require-hashes --only-binary=:all: --implementation cp --python-version "$py" \
  "${platforms[@]}" -d "$out" -r "$out/.wanted"
rm -f "$out/.wanted"
bytes=$(du -sb "$out" | cut -f1)
echo "$out: $(ls "$out"/*.whl | wc -l) wheels, $((bytes / 1000000)) MB"
if [ "$bytes" -gt 60000000 ]; then
  echo "the bundle is over 60 MB" >&2
  exit 1
fi
