"""On a GPU: a real server decodes with the fast runner (csattention) and the reference runner
(every other method), from contexts it built on the GPU; the Final message names the path."""

from dataclasses import replace

import pytest
import torch

from ctxcache.methods import METHODS
from ctxcache.models.loader import load_model
from ctxcache.service.client import Client
from ctxcache.service.gen.v1 import context_pb2 as pb
from ctxcache.service.server import create_server
from service_helpers import tiny_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_put_and_generate_on_cuda(tmp_path, method):
    lm = load_model("random:tiny", device="cuda")
    cfg = tiny_config(tmp_path)
    cfg = replace(cfg, indexer=replace(cfg.indexer, method="csattention"),
                  decoder=replace(cfg.decoder, gpu_slots=2, gpu_slot_tokens=2048))
    server, port = create_server(cfg, lm)
    client = Client(f"127.0.0.1:{port}")
    try:
        info = client.put(pb.PutContextRequest(text="the keeper is named Ada. " * 20, wait=True,
                                               method=pb.MethodSpec(name=method)), timeout=300).context
        assert info.state == pb.CONTEXT_STATE_READY, info.error
        for question in ("who is the keeper?", ""):
            events = list(client.generate(pb.GenerateRequest(
                context_id=info.context_id, question=question, sampling=pb.SamplingParams(max_tokens=8)), timeout=300))
            final = events[-1].final
            assert final.usage.generated_tokens >= 1
            assert final.decode_path == ("gpu-sparse" if method == "csattention" else "reference")
    finally:
        client.close()
        server.stop(0)
