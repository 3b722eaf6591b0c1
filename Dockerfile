# The EPP image: `docker build -t endpoint-picker .` from the repository root.
# Stage 1 installs the dependencies, then the package, into a virtualenv (every dependency ships
# a wheel, so no compiler is needed even here); stage 2 copies only that virtualenv onto a slim
# Python base: no pip cache, no build tools, no source tree, and a non-root user. The Python is
# the one `make test` runs on (tests/unit/test_deploy.py checks): the grpclib drain once hung on
# 3.12 alone.
#
# Reproducible: both stages start from the same base pinned by digest (a tag moves; refresh the
# digest on purpose, from `docker buildx imagetools inspect python:3.11-slim`, in both FROM
# lines), and the dependencies are requirements.lock's exact versions, each file checked
# against its hashes (`pip --require-hashes`), installed in a layer of their own before the
# source is copied, so an edit of the source reuses that layer. `make lock` regenerates the lock
# from pyproject.toml (tests/unit/test_deploy.py checks it covers every dependency).
FROM python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7 AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/epp
WORKDIR /src
COPY requirements.lock ./
RUN /opt/epp/bin/pip install --no-compile --require-hashes --no-deps -r requirements.lock
COPY pyproject.toml README.md ./
COPY src ./src
# --no-build-isolation: build with the locked setuptools above, not a fresh unpinned one
RUN /opt/epp/bin/pip install --no-compile --no-deps --no-build-isolation . \
    && /opt/epp/bin/pip uninstall -y pip setuptools

FROM python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7
ENV PATH=/opt/epp/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/epp /opt/epp
# 65532: the conventional "nonroot" uid; the Deployment asks for the same
USER 65532:65532
EXPOSE 9002 9003 9090
ENTRYPOINT ["epp"]
CMD ["--help"]
