import asyncio
import json
import sys
import tempfile
from pathlib import Path

from bench.inference import service_and_bare
from shared.models.tiny import init_tiny_model
from shared.redis_server import RedisServer

if __name__ == "__main__":
    model_dir = str(init_tiny_model())
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as redis:
        b, s = asyncio.run(service_and_bare(model_dir, "bfloat16", redis.url, int(sys.argv[1])))
    print(json.dumps({"bare": b["tokens_per_s_each"], "svc": s["tokens_per_s_each"], "ratio": round(s["tokens_per_s"]/b["tokens_per_s"],3)}))
