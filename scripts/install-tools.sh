#!/bin/sh
# Install the system tools the tests use:
#   promtool         (Debian package "prometheus")   checks and unit-tests alerts/
#   systemd-analyze  (Debian package "systemd")      verifies the units in systemd/
#   etcd             (Debian package "etcd-server")  the cluster tests start their own
#
# Idempotent: when all are on PATH it exits 0 at once and touches no network.
# Otherwise it runs "apt-get update" once and installs only what is missing, quietly,
# from Debian's own archive. It needs root (or password-less sudo).
#
# The prometheus and etcd-server packages ship servers and enable their units. Tests need
# only the binaries (the cluster tests start etcd themselves), so no server may come up
# from this: a policy-rc.d refusing every service start is in place for the install
# (kept if the machine already has one), recommends (prometheus-node-exporter, another
# daemon) are skipped, and the unit of each package this script installed is disabled
# again so it does not start at the next boot either.
set -eu

missing=""
command -v promtool >/dev/null 2>&1 || missing="$missing prometheus"
command -v systemd-analyze >/dev/null 2>&1 || missing="$missing systemd"
command -v etcd >/dev/null 2>&1 || missing="$missing etcd-server"
[ -z "$missing" ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        exec sudo -n /bin/sh "$0" "$@"
    fi
    echo "install-tools: need root to install:$missing (run: sudo $0)" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-tools: no apt-get here; install by hand:$missing" >&2
    exit 1
fi

log=$(mktemp)
policy=/usr/sbin/policy-rc.d
own_policy=""
cleanup() {
    [ -n "$own_policy" ] && rm -f "$policy"
    rm -f "$log"
}
trap cleanup EXIT
trap 'exit 1' HUP INT TERM

if [ ! -e "$policy" ]; then
    # 101: "action not allowed"; invoke-rc.d and deb-systemd-invoke then start nothing.
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    own_policy=1
fi

started=$(date +%s)
echo "install-tools: installing$missing (apt-get, Debian archive)" >&2
if ! {
    DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
        # $missing is a list of package names on purpose: split it.
        # shellcheck disable=SC2086
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold $missing
} >"$log" 2>&1; then
    cat "$log" >&2
    echo "install-tools: apt-get failed" >&2
    exit 1
fi

case " $missing " in
*" prometheus "*) units="prometheus.service" ;;
*) units="" ;;
esac
case " $missing " in
*" etcd-server "*) units="$units etcd.service" ;;
esac
for unit in $units; do
    # Enabled by the package's postinst; not wanted on a machine that only runs tests.
    # systemctl edits the wants/ symlinks even where systemd is not PID 1.
    if command -v systemctl >/dev/null 2>&1; then
        systemctl disable --now "$unit" >/dev/null 2>&1 ||
            systemctl disable "$unit" >/dev/null 2>&1 || true
    fi
done

for tool in promtool systemd-analyze etcd; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "install-tools: $tool still missing after the install" >&2
        exit 1
    fi
done
echo "install-tools: done in $(($(date +%s) - started)) s" >&2
