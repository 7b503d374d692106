"""Benchmarks: prompt sets, the sweep runner (in-process engine or server), reports, plots, Hugging Face baselines,
the reference testbed and the quickstart. Nothing here imports torch at module load: the CLI stays cheap."""
