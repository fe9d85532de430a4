# Sourced by tools/gpu_run_ab.sh and tools/gpu_run_attn_ab.sh: one A/B configuration,
# label@VAR=value@VAR=value (no spaces), where BENCH=path names the benchmark binary to run
# instead of the default.
#   parse_ab_config CONFIG DEFAULT_BENCH
# sets label, bench and vars (an array of VAR=value for env).
parse_ab_config() {
  local config=$1 rest part parts
  label=${config%%@*}
  vars=()
  bench=$2
  rest=${config#"$label"}
  IFS='@' read -r -a parts <<< "${rest#@}"
  for part in "${parts[@]}"; do
    case "$part" in
      BENCH=*) bench=${part#BENCH=} ;;
      ?*) vars+=("$part") ;;
    esac
  done
}
