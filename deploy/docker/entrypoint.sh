#!/bin/sh
# The image's entrypoint (as /usr/local/bin/tandem-entrypoint): `tandem "$@"`, where
# `tandem serve|gateway|prefill|decode` also take flags from the environment, so that
# compose.yaml and the Kubernetes ConfigMap set them once for every service:
#
#   TANDEM_MODEL               --model (unset or empty: the CLI's default model)
#   TANDEM_SERVED_MODEL_NAME   --served-model-name
#   TANDEM_KV_TRANSPORT        --kv-transport
#   TANDEM_QUANTIZATION        --quantization (fp8: FP8 weights)
#   TANDEM_KV_CACHE_DTYPE      --kv-cache-dtype (fp8: an FP8 KV cache; every worker the same)
#   TANDEM_LOG_LEVEL           --log-level
#   TANDEM_EXTRA_ARGS          any further flags, split on spaces (no quoting, no globbing)
#
# They go right after the subcommand, so flags on the command line itself win (the last one
# given counts). The CLI reads TANDEM_REDIS_URL, TANDEM_API_KEY and TANDEM_ADMIN_TOKEN itself.
set -eu

case "${1:-}" in
  serve|gateway|prefill|decode)
    sub=$1
    shift
    set -f
    # shellcheck disable=SC2086  # word splitting of TANDEM_EXTRA_ARGS is the point
    set -- ${TANDEM_EXTRA_ARGS:-} "$@"
    set +f
    if [ -n "${TANDEM_LOG_LEVEL:-}" ]; then set -- --log-level "$TANDEM_LOG_LEVEL" "$@"; fi
    if [ -n "${TANDEM_KV_CACHE_DTYPE:-}" ]; then set -- --kv-cache-dtype "$TANDEM_KV_CACHE_DTYPE" "$@"; fi
    if [ -n "${TANDEM_QUANTIZATION:-}" ]; then set -- --quantization "$TANDEM_QUANTIZATION" "$@"; fi
    if [ -n "${TANDEM_KV_TRANSPORT:-}" ]; then set -- --kv-transport "$TANDEM_KV_TRANSPORT" "$@"; fi
    if [ -n "${TANDEM_SERVED_MODEL_NAME:-}" ]; then set -- --served-model-name "$TANDEM_SERVED_MODEL_NAME" "$@"; fi
    if [ -n "${TANDEM_MODEL:-}" ]; then set -- --model "$TANDEM_MODEL" "$@"; fi
    set -- "$sub" "$@"
    ;;
esac
exec tandem "$@"
