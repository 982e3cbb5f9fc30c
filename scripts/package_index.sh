# shellcheck shell=bash
# Sourced by scripts/setup.sh and scripts/gpu_check.sh: whether pip can reach a package
# index, decided in at most about 2 seconds, so that no install waits on a network
# time-out where there is no network (the GPU machines reach no index).
#
#   SEQPAR_OFFLINE=1 or 0    decided by the caller (gpu_check.sh --offline sets 1)
#   PIP_NO_INDEX set         offline: pip would use no index anyway
#   otherwise                online if a TCP connection to the index's host opens within
#                            2 s: HTTPS_PROXY's host where one is set, else
#                            PIP_INDEX_URL's, else pypi.org; a file:// index is online
#                            when its folder exists
# The answer is exported (SEQPAR_OFFLINE, SEQPAR_OFFLINE_REASON), so it is decided once
# per run, child scripts included. Needs PYTHON.

# package_index_offline: returns 0 when offline (SEQPAR_OFFLINE_REASON says why), 1 when
# an index is reachable.
package_index_offline() {
  if [ -z "${SEQPAR_OFFLINE:-}" ]; then
    if [ -n "${PIP_NO_INDEX:-}" ] && [ "${PIP_NO_INDEX,,}" != "0" ] && [ "${PIP_NO_INDEX,,}" != "false" ]; then
      SEQPAR_OFFLINE=1 SEQPAR_OFFLINE_REASON="PIP_NO_INDEX is set"
    else
      local answer
      # getaddrinfo ignores the socket's time-out: `timeout` bounds the whole attempt.
      if answer=$(timeout -k 1 2 "${PYTHON:-python3}" - 2>/dev/null <<'PY'
import os
import socket
import urllib.parse

proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
url = urllib.parse.urlsplit(proxy or os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple")
if url.scheme == "file":
    print(url.path)
    raise SystemExit(0 if os.path.isdir(url.path) else 1)
port = url.port or (443 if url.scheme == "https" else 80)
print(f"{url.hostname}:{port}")
try:
    socket.create_connection((url.hostname, port), timeout=1.5).close()
except OSError:
    raise SystemExit(1)
PY
      ); then
        SEQPAR_OFFLINE=0 SEQPAR_OFFLINE_REASON="package index $answer reachable"
      else
        SEQPAR_OFFLINE=1 SEQPAR_OFFLINE_REASON="no connection to the package index${answer:+ $answer} within 2 s"
      fi
    fi
  fi
  if [ -z "${SEQPAR_OFFLINE_REASON:-}" ]; then
    SEQPAR_OFFLINE_REASON="SEQPAR_OFFLINE=$SEQPAR_OFFLINE"
  fi
  export SEQPAR_OFFLINE SEQPAR_OFFLINE_REASON
  [ "$SEQPAR_OFFLINE" = 1 ]
}
