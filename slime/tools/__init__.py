"""Command-line tools beside the training job: the chaos harness, job submission to a Ray
cluster, the APRIL simulator's front end, an OpenAI-compatible server over the built-in engine and the
comparison of finished runs (plot and table).
Each is a `slime` subcommand (slime/cli.py) or ``python -m slime.tools.NAME``."""
