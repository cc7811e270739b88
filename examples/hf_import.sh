# Sourced by the examples that start from a Hugging Face checkpoint (context_extension.sh, long_context_sft.sh): the
# repository's environment, the settings they share, and hf_import, which imports HF_DIR at TP x PP into $WORK/ckpt
# and sets FLAGS (the import's pretrain_gpt.py flag line) and CONTEXT (its --seq-length).
#   WORK (default: a new temporary directory), NPROC (training ranks, default 2), TP (1), PP (2), PYTHON (python3),
#   MASTER_PORT (default: the sourcing script's EXAMPLE_PORT)
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d)}
NPROC=${NPROC:-2}
TP=${TP:-1}
PP=${PP:-2}
MASTER_PORT=${MASTER_PORT:-$EXAMPLE_PORT}
TORCHRUN=("$PYTHON" -m torch.distributed.run --nproc-per-node "$((TP * PP))" --master-port "$MASTER_PORT")

hf_import() {
  "${TORCHRUN[@]}" -m megatron_epp.checkpoint.hf_convert import --hf-dir "$HF_DIR" --save "$WORK/ckpt" \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  read -r -a FLAGS <<< "$("$PYTHON" -m megatron_epp.checkpoint.hf_convert flags --hf-dir "$HF_DIR" --tensor-model-parallel-size "$TP" | cut -d' ' -f2-)"
  CONTEXT=$(printf '%s\n' "${FLAGS[@]}" | grep -A1 -x -- --seq-length | tail -n 1)
}
