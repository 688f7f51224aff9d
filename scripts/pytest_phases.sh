# The suite's two pytest phases, for scripts/test.sh and scripts/compat.sh (source it; both use it alike):
#
#   pytest_parallel PY WORKERS MARKS [pytest args...]   # everything MARKS selects but the `solo` tests, on WORKERS
#                                                       # pytest-xdist workers (tests/parallel.py schedules them)
#   pytest_solo PY MARKS [pytest args...]               # then the `solo` tests, alone, in one process
#
# WORKERS=0 (and no -n in the arguments) runs serially: pytest_parallel then runs the `solo` tests too and the
# pytest_solo after it runs nothing (pytest_parallel leaves PYTEST_RAN_PARALLEL, 1 or 0, for it). Each
# function's status is pytest's (0 passed; pytest_solo's "none selected", 5, counts as passed). If the caller defines
# a function before_alone, it is called before any test runs alone (the reruns, the solo tests): scripts/test.sh
# waits there for ruff and mypy, which run beside the parallel phase.
#
# If one to RERUN_MAX (default 3) tests fail in the parallel run, pytest_parallel runs exactly those again, serially,
# alone; the phase passes only if they pass there, and the output names them, so a test that fails only under the
# other workers' load is seen, not hidden. More failures than that fail the phase as they are. The ids come from
# tests/parallel.py's controller through PYTEST_FAILED_OUT (an environment variable: an option registered by
# tests/conftest.py is unknown to pytest when it parses a command line with no path).

# minutes:seconds since the calling script started, for the headings (CI prints only a part of the output)
stamp() { printf '[%d:%02d]' $((SECONDS / 60)) $((SECONDS % 60)); }

pytest_parallel() {
  local py=$1 workers=$2 marks=$3
  shift 3
  local parallel=0 arg
  [ "$workers" != 0 ] && parallel=1
  for arg in "$@"; do case "$arg" in -n|-n?*|--numprocesses*) parallel=1 ;; esac; done
  PYTEST_RAN_PARALLEL=$parallel
  [ "$parallel" = 1 ] && marks="($marks) and not solo"
  local failed_ids rc=0
  failed_ids=$(mktemp)
  echo "== pytest ($workers workers) $(stamp)"
  PYTEST_FAILED_OUT="$failed_ids" "$py" -m pytest -q -ra --durations=15 -m "$marks" -n "$workers" "$@" || rc=$?
  if [ "$parallel" = 1 ] && [ "$rc" = 1 ]; then
    local failed=()
    mapfile -t failed <"$failed_ids"
    if [ "${#failed[@]}" -ge 1 ] && [ "${#failed[@]}" -le "${RERUN_MAX:-3}" ]; then
      if declare -F before_alone >/dev/null; then before_alone; fi
      echo "== pytest: ${#failed[@]} test(s) failed beside the other workers' load; running them again, alone: $(stamp)"
      printf '   %s\n' "${failed[@]}"
      local rerun=0
      "$py" -m pytest -q -ra -n 0 "${failed[@]}" || rerun=$?
      if [ "$rerun" = 0 ]; then
        rc=0
        echo "== they passed alone (failed under the parallel run's load: see their first failure above) $(stamp)"
      fi
    fi
  fi
  rm -f "$failed_ids"
  return "$rc"
}

pytest_solo() {
  local py=$1 marks=$2
  shift 2
  [ "${PYTEST_RAN_PARALLEL:-1}" = 1 ] || return 0
  if declare -F before_alone >/dev/null; then before_alone; fi
  echo "== pytest: the solo tests, alone $(stamp)"
  local rc=0
  "$py" -m pytest -q -ra -m "solo and ($marks)" "$@" -n 0 || rc=$?
  [ "$rc" = 5 ] && rc=0  # none selected
  return "$rc"
}
