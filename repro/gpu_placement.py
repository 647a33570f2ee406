"""What each actor reserves on a GPU cluster (no Ray, no GPU needed): the learner group's and the
rollout workers' Ray options, as LearnerGroup and start_rollout_worker compute them."""
import sys

from slime.config import load_config
from slime.launch.launcher import worker_resources
from slime.learner import group as g


class FakeLauncher:
    name = "fake"

    def cluster_resources(self):
        return {"CPU": 64.0, "GPU": 8.0}

    def actor(self, cls, *args, name, options):
        print(f"  {name}: num_gpus={options['num_gpus']}")
        return None


for over in sys.argv[1:] or ["cluster.placement=colocated", "cluster.placement=disaggregated"]:
    overrides = over.split() + ["learner.device=cuda", "rollout.device=cuda", "rollout.num_workers=4"]
    cfg = load_config("examples/repeat_grpo.yaml", overrides)
    print(over, "| required:", g.required_resources(cfg), "| transport:", cfg.weight_transport)
    g.LearnerGroup(cfg, "m", "redis://x", None, FakeLauncher())
    for i in range(cfg.rollout.num_workers):
        need = worker_resources(cfg)
        print(f"  rollout-{i}: num_gpus={need.get('GPU', 0.0)} device={cfg.rollout.device}")
