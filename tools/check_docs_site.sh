#!/usr/bin/env bash
# Build the documentation site, serve it, and open it in headless Chromium: the home page must
# render its navigation and content; screenshots of the home page and the configuration
# reference are written to OUT (default: docs-screenshots/).
#   bash tools/check_docs_site.sh [OUT]      (needs `pip install -e '.[docs]'` and chromium)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs-screenshots}
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$browser" ] || { echo "check_docs_site: no chromium found (apt install chromium)" >&2; exit 1; }
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$site" >/dev/null 2>&1 &
server=$!
trap 'kill $server; rm -rf "$site"' EXIT
sleep 1
chrome() { "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars "$@" 2>/dev/null; }
dom=$(chrome --dump-dom "http://127.0.0.1:$port/")
for text in "What it does" "Getting started" "Configuration" "Command line" "md-nav"; do
  grep -q "$text" <<<"$dom" || { echo "check_docs_site: the home page lacks '$text'" >&2; exit 1; }
done
mkdir -p "$out"
chrome --window-size=1280,900 --screenshot="$out/home.png" "http://127.0.0.1:$port/"
chrome --window-size=1280,1400 --screenshot="$out/config-reference.png" "http://127.0.0.1:$port/reference/config/"
echo "check_docs_site: the home page renders; screenshots in $out/"
