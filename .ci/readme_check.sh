#!/usr/bin/env bash
# The README proved on a clean install: a fresh clone, a fresh venv holding only what the README's
# install lines put there (no torch, no test extras), offline, an empty conversion cache; then the
# main command as a newcomer runs it. Usage: readme_check.sh WORKDIR
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$1"
rm -rf "$work" && mkdir -p "$work"
git clone -q "$repo" "$work/clone"
cd "$work/clone"

echo "== README install lines, run as written =="
python3 .ci/readme_block.py readme-install | tee "$work/install.sh"
# Quiet pip, as a log would be; the lines themselves are the README's.
PIP_QUIET=1 PIP_DISABLE_PIP_VERSION_CHECK=1 bash -euo pipefail "$work/install.sh"
venv="$work/clone/.venv"
if "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "the README venv has torch: it would hide a missing dependency" >&2; exit 1
fi

export HF_HUB_OFFLINE=1 MLX_DFLASH_CACHE="$work/cache"

echo "== dflash-mlx generate --chat --json =="
"$venv/bin/dflash-mlx" generate --chat -p "What is the capital of France?" --json > "$work/generate.json"
"$venv/bin/python" - "$work/generate.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
print(json.dumps({k: doc[k] for k in ("text", "tau", "draft", "generation_tokens")}))
assert "Paris" in doc["text"], doc["text"]
assert doc["draft"] is True, "the embedded pair runs with its drafter"
PY

echo "== dflash-mlx chat in tmux =="
sock="readme-$$"
pane() { tmux -L "$sock" capture-pane -p -t chat -S - 2>/dev/null || true; }
wait_for() {  # wait_for REGEX SECONDS
  for _ in $(seq 1 "$2"); do
    if pane | tr -d '\n' | grep -Eq "$1"; then return 0; fi
    sleep 1
  done
  echo "timed out waiting for /$1/; the screen:" >&2; pane >&2; return 1
}
tmux -L "$sock" new-session -d -s chat -x 120 -y 50 \
  "env HF_HUB_OFFLINE=1 MLX_DFLASH_CACHE='$MLX_DFLASH_CACHE' '$venv/bin/dflash-mlx' chat --max-tokens 64; echo \"[chat exited: \$?]\"; sleep 600"
trap 'tmux -L "$sock" kill-server 2>/dev/null || true' EXIT
wait_for '>>> $|>>> *$' 180
tmux -L "$sock" send-keys -t chat "What is the capital of France?" Enter
wait_for '[0-9]+ tokens · [0-9.]+ tok/s · tau' 180
wait_for 'Paris' 5
tmux -L "$sock" send-keys -t chat "/exit" Enter
wait_for '\[chat exited: 0\]' 30  # /exit leaves with status 0
pane | sed -e '/^$/d' | tee "$work/chat.txt"
echo "README check passed"
