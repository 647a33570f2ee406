"""How a job's processes are started: on Ray (ray_cluster.py). A launcher without Ray sits beside it."""
