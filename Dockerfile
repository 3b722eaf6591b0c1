# The EPP image: `docker build -t endpoint-picker .` from the repository root.
# Stage 1 builds the package and its dependencies into a virtualenv (every dependency ships a
# wheel, so no compiler is needed even here); stage 2 copies only that virtualenv onto a slim
# Python base: no pip cache, no build tools, no source tree, and a non-root user. The Python is
# the one `make test` runs on (tests/unit/test_deploy.py checks): the grpclib drain once hung on
# 3.12 alone.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/epp
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN /opt/epp/bin/pip install --no-compile . \
    && /opt/epp/bin/pip uninstall -y pip setuptools wheel

FROM python:3.11-slim
ENV PATH=/opt/epp/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/epp /opt/epp
# 65532: the conventional "nonroot" uid; the Deployment asks for the same
USER 65532:65532
EXPOSE 9002 9003 9090
ENTRYPOINT ["epp"]
CMD ["--help"]
