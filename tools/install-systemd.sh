#!/usr/bin/env bash
# Put npud's systemd units, its sysusers.d and tmpfiles.d entries and the example configuration
# in place (docs/operations.md, "Install").
#
#   tools/install-systemd.sh [--npud PATH] [--root DIR]
#
#   --npud PATH  the npud executable that ExecStart= runs (default: the npud on $PATH)
#   --root DIR   install into DIR, a staging tree or package root, and run nothing there
#
# Into / (the default; needs root) it also creates the users and groups (systemd-sysusers),
# the runtime directory (systemd-tmpfiles) and reloads systemd. It enables and starts nothing,
# and never overwrites an existing /etc/npud/npud.toml.
set -euo pipefail

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

npud=""
root="/"
while [ $# -gt 0 ]; do
    case "$1" in
        --npud) npud="${2:?--npud needs a path}"; shift 2 ;;
        --root) root="${2:?--root needs a directory}"; shift 2 ;;
        -h|--help) usage 0 ;;
        *) echo "install-systemd.sh: unknown argument: $1" >&2; usage 2 >&2 ;;
    esac
done

src="$(cd "$(dirname "$0")/../systemd" && pwd)"
if [ -z "$npud" ]; then
    npud="$(command -v npud || true)"
    [ -n "$npud" ] || { echo "install-systemd.sh: no npud on \$PATH; install npud first or pass --npud PATH" >&2; exit 1; }
fi
case "$npud" in
    /*) ;;
    *) echo "install-systemd.sh: --npud must be an absolute path (ExecStart= needs one): $npud" >&2; exit 1 ;;
esac
[ -x "$npud" ] || { echo "install-systemd.sh: $npud is not an executable file" >&2; exit 1; }

dest="${root%/}"
install -d -m 0755 "$dest/etc/systemd/system" "$dest/etc/sysusers.d" "$dest/etc/tmpfiles.d"
# the unit names the executable by absolute path: put the installed one in
sed "s#^ExecStart=/usr/local/bin/npud #ExecStart=$npud #" "$src/npud.service" > "$dest/etc/systemd/system/npud.service"
grep -q "^ExecStart=$npud " "$dest/etc/systemd/system/npud.service" \
    || { echo "install-systemd.sh: could not set ExecStart= in npud.service" >&2; exit 1; }
chmod 0644 "$dest/etc/systemd/system/npud.service"
install -m 0644 "$src/npud.socket" "$dest/etc/systemd/system/npud.socket"
install -m 0644 "$src/npud.sysusers" "$dest/etc/sysusers.d/npud.conf"
install -m 0644 "$src/npud.tmpfiles" "$dest/etc/tmpfiles.d/npud.conf"
if [ -e "$dest/etc/npud/npud.toml" ]; then
    echo "kept the existing $dest/etc/npud/npud.toml (the example is $src/npud.toml)"
else
    install -D -m 0644 "$src/npud.toml" "$dest/etc/npud/npud.toml"
fi
echo "installed npud.service (ExecStart=$npud), npud.socket, sysusers.d/npud.conf, tmpfiles.d/npud.conf under ${dest:-/}/etc"

if [ "$root" = "/" ]; then
    systemd-sysusers /etc/sysusers.d/npud.conf
    systemd-tmpfiles --create /etc/tmpfiles.d/npud.conf
    systemctl daemon-reload
    cat <<EOF
next:
  edit /etc/npud/npud.toml (at least the [[models]]), then: npud --check-config --config /etc/npud/npud.toml
  systemctl enable --now npud.socket npud.service
  usermod -aG npu USER          # who may use npud; operators also: usermod -aG npud-admin USER
EOF
fi
