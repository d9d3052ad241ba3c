"""Benchmarks of the repository (not shipped in the wheel); run each from the repository root as
`python -m bench.<module>` (see bench/README.md)."""
