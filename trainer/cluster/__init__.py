"""Who is in the cluster and where its tasks run: the cluster spec from
flags, TF_CONFIG or Slurm (spec, slurm), device names and placement
(devices), and the local launcher that starts a whole cluster as processes
on this machine (local). Imports only trainer.common."""
