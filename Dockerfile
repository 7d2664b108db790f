# Dockerfile — taskhub in a small Debian image.
#
#   docker build -t taskhub .
#   docker run --rm -e REDIS_URL=... -e DATABASE_URL=... taskhub run
#
# Stage 1 compiles with the official Rust image (Cargo.lock is honoured,
# --locked); stage 2 holds only the binary, the CA certificates (the
# system's trust store for TLS, which is rustls inside the binary: no
# OpenSSL) and a non-root user. The migrations are embedded in the binary.

FROM rust:1-bookworm AS builder
WORKDIR /src
COPY . .
# Stripped: the release profile keeps line tables for profiling (70 MB);
# the image needs none of it (about 10 MB).
RUN cargo build --release --locked \
 && strip -o /usr/local/bin/taskhub target/release/taskhub

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin taskhub
COPY --from=builder /usr/local/bin/taskhub /usr/local/bin/taskhub
USER taskhub
# The worker drains in-flight events on SIGTERM (docker stop's default).
STOPSIGNAL SIGTERM
ENTRYPOINT ["taskhub"]
CMD ["run"]
