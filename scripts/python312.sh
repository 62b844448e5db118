# Sourced by the scripts that build a Python 3.12 venv: find_python312 prints an interpreter (PYTHON312, else
# pyenv's own 3.12 builds, else python3.12 on PATH) or exits 1 with one line.
find_python312() {
  if [ -n "${PYTHON312:-}" ]; then echo "$PYTHON312"; return; fi
  local root candidate
  root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
  # pyenv's own builds first (its python3.12 shim on PATH fails unless 3.12 is selected), then PATH.
  for candidate in "$root"/versions/3.12*/bin/python3.12 "$(command -v python3.12 || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" --version >/dev/null 2>&1; then
      echo "$candidate"
      return
    fi
  done
  echo "no Python 3.12 found (set PYTHON312=/path/to/python3.12)" >&2
  exit 1
}
