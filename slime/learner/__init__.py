"""The learner group (docs/architecture.md room 3): N Ray actors, one torch.distributed group, FSDP2 shards.

- actor.py     one rank: claims, updates, publishes weights, checkpoints (the whole learner at N=1)
- group.py     the driver's handle on the N ranks: placement, rendezvous, calls fanned out to all
- sharding.py  what the ranks share: FSDP2, the token-balanced split, sums, sharded checkpoints
- forwards.py  the policy's response logprobs and the critic's values, padded or packed
- packing.py   padding-free micro-batches: rows end to end, attention kept inside each row
- lora.py      learner.lora: peft's adapters in the policy, the base as reference, adapter pushes and checkpoints
"""

from slime.algorithms.batch import collate
from slime.learner.actor import Learner
from slime.learner.forwards import ValueModel, response_logprobs
from slime.learner.group import LearnerGroup, ResourceError, learner_resources, required_resources

__all__ = [
    "Learner",
    "LearnerGroup",
    "ResourceError",
    "ValueModel",
    "collate",
    "learner_resources",
    "required_resources",
    "response_logprobs",
]
