"""The small-scale replication of the papers' claims (bench/results/REPLICATION.md); run each from the repository
root as `python -m bench.replication.<module>`."""
