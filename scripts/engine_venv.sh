# Sourced by vllm_env.sh and sglang_env.sh: what building a serving engine's own venv has in common.
# Each engine pins its own dependency set, so it gets a venv of its own next to .venv, and kvcache
# is linked into it from the source tree (editable, without its dependencies).
#
# Callers set: repo, venv, py, and a log function.

# Serialize builders of one venv: scripts/test.sh starts the build in the background while the rest
# of the suite runs, and the tests that need the venv call the same script, which must wait for
# that build rather than race it. The lock is held until the calling script exits.
lock_venv() {
  mkdir -p "$(dirname "$venv")"
  exec 9>"$venv.lock"
  if ! flock -n 9; then
    log "waiting for another build of $venv"
    flock 9
  fi
}

# Point the venv at this source tree (re-run when the checkout moved) and install whichever of
# kvcache's runtime dependencies the engine did not already bring. Extra arguments go to pip.
link_kvcache() {
  local site missing=() mod
  site="$(cd / && "$py" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')"
  if [ "$(cat "$site/kvcache-src.pth" 2>/dev/null)" != "$repo" ]; then
    log "linking kvcache from $repo"
    echo "$repo" > "$site/kvcache-src.pth"
  fi
  for mod in msgspec:msgspec zmq:pyzmq prometheus_client:prometheus-client redis:redis \
             opentelemetry.sdk:opentelemetry-sdk; do
    (cd / && "$py" -c "import ${mod%%:*}") >/dev/null 2>&1 || missing+=("${mod##*:}")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    log "installing missing: ${missing[*]}"
    "$py" -m pip install --quiet "$@" "${missing[@]}" >&2
  fi
}
