#!/usr/bin/env bash
# Wheels for running tandem's cluster benchmarks on an offline Python 3.12 machine that has torch,
# transformers and grpcio but not Ray (the lent GPU hosts of docs/gpu.md). Writes .whl/serve/
# (git-ignored; under 55 MB, so it can travel with the repository):
#   ray 2.60 repacked without its Java jars, dashboard web UI and RLlib (79 -> 42 MB), and what
#   Serve and tandem import that such an image lacks (pydantic, fastapi, grpcio 1.85, ...).
# On the machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/serve/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 bench/overhead.py --requests 100
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl/serve
mkdir -p "$out" .whl/download
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude

wheels=(
  ray==2.60.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0
  opentelemetry-api==1.45.2 grpcio==1.85.1 grpcio-health-checking==1.85.1
  grpcio-reflection==1.85.1 protobuf==7.36.2 jsonschema==4.26.0 referencing==0.37.0
  jsonschema-specifications==2025.9.1 rpds-py==2026.9.1
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl/download "${wheels[@]}"

for whl in .whl/download/*.whl; do
  case "$(basename "$whl")" in
    ray-*) ;;
    *) cp "$whl" "$out/" ;;
  esac
done

# Ray without what a headless benchmark never loads; RECORD keeps only the files left.
python3 - "$out" .whl/download/ray-2.60.0-*.whl <<'EOF'
import csv, io, pathlib, sys, zipfile

out, source = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
skip = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/")
with zipfile.ZipFile(source) as src, zipfile.ZipFile(out / source.name, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if info.filename.startswith(skip):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and not r[0].startswith(skip)]
            text = io.StringIO()
            csv.writer(text, lineterminator="\n").writerows(rows)
            data = text.getvalue().encode()
        dst.writestr(info, data)
EOF
du -sh "$out"
