# dpstream worker image. Build from the repository root:
#   docker build -t dpstream:0.2.0 .
# Run (the chart in helm/dpstream does the same with a mounted config, secret and volume):
#   docker run --rm -v $PWD/examples/worker.yaml:/etc/dpstream/queries.yaml:ro \
#     -v $PWD/noise.key:/run/secrets/noise.key:ro -e DPSTREAM_NOISE_KEY_FILE=/run/secrets/noise.key \
#     -e DPSTREAM_BROKER=host.docker.internal:19092 -p 9400:9400 dpstream:0.2.0
ARG PYTHON_IMAGE=python:3.11-slim

# Build stage: install dpstream and its pinned dependencies (constraints.txt fixes every
# transitive version; no test or bench extras) into a virtualenv.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/dpstream
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY accountant ./accountant
COPY processor ./processor
COPY state ./state
COPY topics ./topics
COPY dpstream ./dpstream
RUN /opt/dpstream/bin/pip install --no-cache-dir -c constraints.txt . \
 && /opt/dpstream/bin/dpstream --help > /dev/null

# Runtime stage: the virtualenv only, run as a non-root user (uid/gid 10001, as in the chart).
FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 dpstream \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/dpstream --create-home \
      --shell /usr/sbin/nologin dpstream \
 && mkdir -p /etc/dpstream /var/lib/dpstream \
 && chown 10001:10001 /var/lib/dpstream
COPY --from=build /opt/dpstream /opt/dpstream
ENV PATH=/opt/dpstream/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    DPSTREAM_STATE_DIR=/var/lib/dpstream
USER 10001:10001
WORKDIR /home/dpstream
# /healthz, /readyz and /metrics (DPSTREAM_WEB_PORT)
EXPOSE 9400
ENTRYPOINT ["dpstream"]
CMD ["worker", "--config", "/etc/dpstream/queries.yaml"]
