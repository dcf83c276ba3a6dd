#!/usr/bin/env bash
# Installs Debian's `prometheus` package when the binary is missing (the metrics tests start a
# real Prometheus). Needs apt-get and root; otherwise says what to do and exits 1.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing prometheus (Debian package)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || {
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends prometheus >/dev/null
  }
  exit 0
fi
echo "[setup] the metrics tests need a 'prometheus' binary on PATH (Debian/Ubuntu: apt-get install prometheus)" >&2
exit 1
