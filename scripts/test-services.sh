#!/usr/bin/env bash
# Installs the system services the tests start themselves (each test session starts its own
# instances on free loopback ports and stops them).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x scripts/redis.sh ]; then
  bash scripts/redis.sh install
fi
if [ -x scripts/nginx.sh ]; then
  bash scripts/nginx.sh install
fi
if [ -x scripts/chromium.sh ]; then
  bash scripts/chromium.sh install
fi
if [ -x scripts/haproxy.sh ]; then
  bash scripts/haproxy.sh install
fi
