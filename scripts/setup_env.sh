#!/usr/bin/env bash
# Install the pinned CPU environment (torch 2.13.0 CPU wheel, megatron-core 0.16.1, ...). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --disable-pip-version-check -q -r requirements.txt
