#!/usr/bin/env bash
# The top end of what pyproject.toml promises: the whole test suite on Python 3.13 with the
# newest jax, flax and optax that pip serves there (scripts/test.sh, without --newest, tests
# the floor). Python 3.13 is Debian 13's python3, so the suite runs in a Debian 13 root made
# with debootstrap and entered with chroot: root, Linux and debootstrap needed. Run it as
# `bash scripts/test.sh --newest`, as CI does; extra arguments go to pytest. Lint, format and
# the strict docs build run once, in the floor's environment, not here.
#
# Cached in .cache/newest/ (git-ignored): the root, remade when the Debian packages below
# change, and its venv, remade when this script or pyproject.toml changes. A cached venv
# keeps the versions that were newest when it was made (`rm -rf .cache/newest/root/opt` takes
# today's); CI starts from a clean checkout, so it always tests the newest.
set -euo pipefail
cd "$(dirname "$0")/.."

suite=trixie # Debian 13
packages=python3,python3-venv,ca-certificates
cache=$PWD/.cache/newest
root=$cache/root
venv=/opt/venv # in the root

if [ "$(id -u)" != 0 ] || [ "$(uname -s)" != Linux ]; then
  echo "test-newest: needs root on Linux (debootstrap, mount and chroot)" >&2
  exit 1
fi

# Debian's packages come from the mirror this machine's apt uses, its first .../debian
# address (deb822 "URIs:" lines and one-line "deb" lines), unless JAXGA_DEBIAN_MIRROR names one.
debian_mirror() {
  if [ -n "${JAXGA_DEBIAN_MIRROR:-}" ]; then
    echo "$JAXGA_DEBIAN_MIRROR"
    return
  fi
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
    2>/dev/null \
    | sed -n -E 's/^URIs:[[:space:]]*//p; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//p' \
    | tr ' ' '\n' | grep -m1 -E '^https?://.*/debian/?$' || true
}

# Runs a command in the root, as root, with a clean environment but for pip's settings (so
# pip reaches the registry as it does here; not find-links, folders of this machine's, which
# pip would warn of once per package) and proxies. The mounts live in a mount namespace
# of the command's own and end with it, so none is left behind, whatever stops the command:
# /proc (without it XLA's CPU backend cannot read the CPU's features and every reduction fails
# with "YNNPACK operation failed: unsupported parameter"), /dev, /sys and this checkout as /src.
in_root() {
  local vars=(HOME=/root PATH="$venv/bin:/usr/bin:/bin" LANG=C.UTF-8)
  local var
  while IFS= read -r -d '' var; do
    case $var in
      PIP_FIND_LINKS=*) ;;
      PIP_* | http_proxy=* | https_proxy=* | no_proxy=* | HTTP_PROXY=* | HTTPS_PROXY=* | NO_PROXY=*)
        vars+=("$var")
        ;;
    esac
  done < <(env -0)
  # shellcheck disable=SC2016  # expanded by the inner bash
  unshare --mount --propagation private -- bash -c '
    set -euo pipefail
    root=$1 && shift
    mount --bind /proc "$root/proc"
    mount --rbind /dev "$root/dev"
    mount --rbind /sys "$root/sys"
    mkdir -p "$root/src" && mount --bind "$PWD" "$root/src"
    exec chroot "$root" /usr/bin/env -i "$@"' bash "$root" "${vars[@]}" \
    /bin/sh -c 'cd /src && exec "$@"' sh "$@"
}

# The root: debootstrap once per suite and package list, into a folder moved in place only
# when complete, so an interrupted build is redone rather than used.
want_root="$suite $packages"
if [ "$(cat "$cache/root.stamp" 2>/dev/null)" != "$want_root" ]; then
  mirror=$(debian_mirror)
  if [ -z "$mirror" ]; then
    echo "test-newest: no Debian mirror in /etc/apt/sources.list*; set JAXGA_DEBIAN_MIRROR" >&2
    exit 1
  fi
  command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap; }
  echo "test-newest: building a Debian $suite root in $root (once)" >&2
  # in_root's mounts are private to its namespaces; anything else mounted here stops us
  if grep -q " $cache/" /proc/mounts; then
    echo "test-newest: something is mounted under $cache; unmount it first" >&2
    exit 1
  fi
  rm -rf "$cache"
  mkdir -p "$cache"
  debootstrap --variant=minbase --include="$packages" "$suite" "$root.tmp" "$mirror" \
    >"$cache/debootstrap.log" 2>&1 || {
    tail -n 20 "$cache/debootstrap.log" >&2
    exit 1
  }
  mv "$root.tmp" "$root"
  printf '%s' "$want_root" >"$cache/root.stamp"
fi

# What lets pip in the root reach the registry as pip does here, copied afresh each run:
# DNS, pip's system-wide configuration, and the CA bundle (it may hold a proxy's own CA).
for file in /etc/resolv.conf /etc/pip.conf /etc/xdg/pip /etc/ssl/certs/ca-certificates.crt \
  ${PIP_CERT:+"$PIP_CERT"}; do
  if [ -e "$file" ]; then
    rm -rf "$root$file"
    mkdir -p "$(dirname "$root$file")"
    cp -rL "$file" "$root$file"
  fi
done

# The venv: made anew (with the newest releases) when this script or pyproject.toml changes.
# The extras are scripts/setup.sh's, docs among them for tests/test_site.py.
want_venv=$(cat scripts/test-newest.sh pyproject.toml | sha256sum)
if [ "$(cat "$root$venv/.jaxga-installed" 2>/dev/null)" != "$want_venv" ]; then
  echo "test-newest: installing jaxga[examples,dev,docs] into $venv in the root" >&2
  rm -rf "$root$venv"
  in_root python3 -m venv "$venv"
  in_root python -m pip install --quiet --upgrade pip
  in_root python -m pip install --quiet -e ".[examples,dev,docs]"
  printf '%s' "$want_venv" >"$root$venv/.jaxga-installed"
fi

# What is tested, for the log; then the whole suite.
in_root python -c '
import importlib.metadata as m, sys
print("test-newest: Python", sys.version.split()[0], *(
    f"{name} {m.version(name)}" for name in ("jax", "jaxlib", "flax", "optax")))' >&2
# The compiled-for-H100 checks run at the floor only: jaxlib 0.12.0.1's XLA cannot compile for
# a described GPU without one ("CublasLtBackend cannot enumerate configs in deviceless mode",
# then a segmentation fault), so here they skip and say why.
h100="JAXGA_H100_PLUGIN_MISSING=the compiled-for-H100 checks run at the floor: this jaxlib \
cannot compile for a GPU it does not have (CublasLt autotuning in deviceless mode)"
in_root env JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" "$h100" python -m pytest -n 2 "$@"
