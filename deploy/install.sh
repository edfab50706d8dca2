#!/usr/bin/env bash
# Installs the HWR daemon as a systemd service.
#
#   sudo deploy/install.sh                 # install, create user/group, enable and start
#   DESTDIR=/tmp/pkg deploy/install.sh     # stage files only (packaging, tests)
#
# Assumes `hwr` is installed (pip install .) and on PATH (or HWR_BIN=...).
# Workers that use the store must be in the `hwr` group:
#   sudo usermod -aG hwr <worker-user>
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
dest="${DESTDIR:-}"
hwr_bin="${HWR_BIN:-$(command -v hwr || echo /usr/local/bin/hwr)}"

install -d -m 0755 "$dest/etc/systemd/system" "$dest/usr/lib/tmpfiles.d" "$dest/etc/hwr"
sed "s#/usr/local/bin/hwr#${hwr_bin}#" "$here/systemd/hwr.service" > "$dest/etc/systemd/system/hwr.service"
chmod 0644 "$dest/etc/systemd/system/hwr.service"
install -m 0644 "$here/systemd/hwr.tmpfiles" "$dest/usr/lib/tmpfiles.d/hwr.conf"
# Never overwrite an operator's config.
if [ ! -e "$dest/etc/hwr/hwr.toml" ]; then
    install -m 0644 "$here/hwr.toml.example" "$dest/etc/hwr/hwr.toml"
fi

if [ -n "$dest" ]; then
    echo "staged under $dest (no users created, systemd untouched)"
    exit 0
fi

getent group hwr >/dev/null || groupadd --system hwr
getent passwd hwr >/dev/null || useradd --system --gid hwr --home-dir /var/lib/hwr --shell /usr/sbin/nologin hwr
systemd-tmpfiles --create /usr/lib/tmpfiles.d/hwr.conf
systemctl daemon-reload
systemctl enable --now hwr.service
# Type=notify: this returns once recovery is done and the sockets serve.
systemctl --no-pager status hwr.service || true
echo "installed; add worker users to the hwr group: usermod -aG hwr USER"
